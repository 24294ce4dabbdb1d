"""Measure an engine's throughput curve: decode step time against sequences in flight, and prefill cost.

For the tiny model on the embedded engine and on SGLang's CPU server (from patchgym's CPU venv),
in one run:
- decode: `B` requests sent at once, each generating `--new-tokens` tokens (EOS ignored), for B in
  `--batches`; a decode step's time is (time for N tokens - time for 1 token) / (N - 1), so that
  the prefill is left out;
- prefill: one request with a long and with a short prompt and one new token; the difference
  per prompt token.
Times are CPU seconds of the engine's processes by default (`--clock cpu`: the benchmark
process for the embedded engine, the server's process group for SGLang), which a busy machine
does not inflate the way it inflates elapsed time; `--clock wall` measures elapsed time.
Medians over `--rounds`; a robust (Theil-Sen) line `step = base + per_seq * B` is fitted through
the decode points. The curves are printed and written to `--out` (default
benchmarks/engine_curve.json), which benchmarks/longtail.py reads.

    python benchmarks/engine_curve.py [--engines embedded,sglang] [--rounds 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sim_clock import EngineCurve

from patchgym.core.inference import InferenceEngine, SamplingParams
from patchgym.models.tiny import init_tiny_model

console = Console(width=120)
SHORT_PROMPT, LONG_PROMPT = 32, 512


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(count)]


Clock = Callable[[], float]


def session_cpu_clock(session_id: int) -> Clock:
    """CPU seconds (user + system) used so far by every live process of a session (a server's group)."""
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process ended while we looked
            if int(fields[3]) == session_id:  # field 6 of stat: the session id
                total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
        return total / tick

    return read


async def timed(engine: InferenceEngine, batch: list[list[int]], new_tokens: int, clock: Clock) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    start = clock()
    generations = await asyncio.gather(*(engine.generate(p, params) for p in batch))
    seconds = clock() - start
    produced = {len(g.token_ids) for g in generations}
    if produced != {new_tokens}:
        raise RuntimeError(f"expected {new_tokens} tokens per request, got {sorted(produced)}: EOS not ignored?")
    return seconds


async def measure(engine: InferenceEngine, args: argparse.Namespace, clock: Clock) -> dict:
    batches, new_tokens, rounds = args.batches, args.new_tokens, args.rounds
    await timed(engine, prompts(2, SHORT_PROMPT, 0), 4, clock)  # warm-up
    steps: dict[int, float] = {}
    for size in batches:
        batch = prompts(size, SHORT_PROMPT, size)
        samples = []
        for _ in range(rounds):
            full = await timed(engine, batch, new_tokens, clock)
            first = await timed(engine, batch, 1, clock)
            samples.append(max(full - first, 1e-9) / (new_tokens - 1))
        steps[size] = statistics.median(samples)
    prefill = []
    for index in range(rounds):
        long = await timed(engine, prompts(1, LONG_PROMPT, 1000 + index), 1, clock)
        short = await timed(engine, prompts(1, SHORT_PROMPT, 2000 + index), 1, clock)
        prefill.append(max(long - short, 1e-9) / (LONG_PROMPT - SHORT_PROMPT))
    curve = EngineCurve.fit(steps, statistics.median(prefill))
    return {"clock": args.clock, "decode_step_s": {str(k): v for k, v in steps.items()}, "fit": curve.__dict__}


async def embedded(model_dir: Path, args: argparse.Namespace) -> dict:
    from patchgym.backends.inference.embedded import EmbeddedEngine

    engine = EmbeddedEngine(
        model_dir, max_context=LONG_PROMPT + args.new_tokens + 8, max_batch_size=max(args.batches), stop_at_eos=False
    )
    try:
        return await measure(engine, args, time.process_time if args.clock == "cpu" else time.perf_counter)
    finally:
        await engine.aclose()


def sglang(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    from patchgym.backends.inference.sglang import SGLangEngine
    from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings, launch_sglang, stop_servers
    from patchgym.backends.inference.sglang_venv import build_sglang_venv, stubs_path, venv_python

    venv = build_sglang_venv(progress=lambda message: console.print(message))
    context = LONG_PROMPT + args.new_tokens + 8
    settings = SGLangLaunchSettings(
        model_path=model_dir,
        python=venv_python(venv),
        base_port=args.port,
        device="cpu",
        context_length=context,
        mem_fraction_static=None,
        max_total_tokens=context * max(args.batches),
        max_running_requests=max(args.batches),
        dtype="float32",
        stubs_dir=stubs_path(venv),
    )
    servers = launch_sglang(settings, log_dir)

    async def run() -> dict:
        engine = SGLangEngine([s.url for s in servers], max_context=context, ignore_eos=True)
        clock = session_cpu_clock(servers[0].process.pid) if args.clock == "cpu" else time.perf_counter
        try:
            return await measure(engine, args, clock)
        finally:
            await engine.aclose()

    try:
        return asyncio.run(run())
    finally:
        stop_servers(servers)


def main(args: argparse.Namespace) -> None:
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = init_tiny_model(Path(scratch) / "tiny", seed=0)
        for name in args.engines:
            console.print(f"measuring {name} ...")
            if name == "embedded":
                results[name] = asyncio.run(embedded(model_dir, args))
            elif name == "sglang":
                results[name] = sglang(model_dir, args, Path(scratch) / "logs")
            else:
                raise SystemExit(f"unknown engine {name!r}: use embedded or sglang")
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    table = Table("engine", *(f"B={b}" for b in args.batches), "fit: base + per seq", "prefill / token")
    for name, result in results.items():
        if list(result["decode_step_s"]) != [str(b) for b in args.batches]:
            continue  # measured at other batch sizes by an earlier run
        fit = result["fit"]
        table.add_row(
            name,
            *(f"{int(b) / step:,.0f} tok/s" for b, step in result["decode_step_s"].items()),
            f"{fit['decode_base_s'] * 1e3:.2f} ms + {fit['decode_per_seq_s'] * 1e3:.3f} ms",
            f"{fit['prefill_per_token_s'] * 1e6:.1f} us",
        )
    console.print(table)
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=lambda s: s.split(","), default=["embedded", "sglang"])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=31870)
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: CPU seconds of the engine's processes (steady on a busy machine); wall: elapsed seconds",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("engine_curve.json"))
    main(parser.parse_args())
