"""Weight sync, the ways a trainer hands weights to an engine, beside a raw gloo broadcast, in one run.

For each model (Qwen3s with the tiny model's tokenizer, from about 1M to about 100M parameters) it times:
- raw: a gloo broadcast of the same tensors, in the same order, from one process to another on
  127.0.0.1 (group formed beforehand; each round ends when the receiver acknowledges): the rate
  the network path allows;
- stream: the Megatron trainer's streamed sync (`megatron_sync`), the way a run syncs: a one-rank
  `MegatronTrainer` holding the model, `WeightSync(mode="distributed")` into a receiving engine
  process (`patchgym.testing.weight_receiver`), buckets of `--bucket-fraction` of the model (an
  eighth: at least 8 buckets); the group forms in the warm-up round and is reused after; the
  sender's extra peak memory is the streamer's own count (`SyncStats`);
With `--sglang` (the CPU SGLang venv), also:
- distributed: `SGLangEngine.update_weights(DistributedWeights(...))` into a real CPU SGLang
  server (patchgym's CPU SGLang venv): group rendezvous, bucketed broadcast, the engine loading
  the buckets, version and cache flush, group teardown; the whole call;
- tensor: `EmbeddedEngine.update_weights(state_dict)`, the in-memory hand-off of the embedded stack;
- disk: `save_file` of the state dict as safetensors, then SGLang's `/update_weights_from_disk`.
Each runs `--warmup` + `--rounds` times with fresh weights (the model's plus noise). The first
syncs into a process are slower (the receiver's buffers are fresh memory, page-faulted in; later
rounds reuse the allocator's pages), so the warm-up rounds are reported apart ("first") and the
medians of the other rounds are the steady state a training run sees after its first step, as
seconds and GB/s of the fp32 state dict, with each way's rate as a ratio of the raw broadcast's.

    nice python benchmarks/weight_sync.py [--rounds 5] [--warmup 1] [--models 1m,10m,100m] [--sglang] [--json]

With `--json` the last line is `{"rows": [{"way", "model", "params", "model_bytes", "bucket_bytes",
"sender_extra_peak_bytes", "seconds", "first_s", "gb_s", "ratio_vs_raw"}, ...]}`, one row per way
and model (raw's ratio is 1). Targets (issue 29): stream's sender extra peak <= 3 buckets; the 1M
model's stream >= 0.5x raw, the 100M one's >= 0.8x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from patchgym.backends.inference.embedded import EmbeddedEngine
from patchgym.backends.inference.sglang import DistributedWeights, SGLangEngine
from patchgym.backends.inference.sglang_launch import SGLangLaunchSettings, launch_sglang, stop_servers
from patchgym.backends.inference.sglang_venv import build_sglang_venv, stubs_path, venv_python
from patchgym.models.tiny import init_tiny_model
from patchgym.process_groups import handle_interrupts

console = Console()
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "1m": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3, "head_dim": 32},
    "10m": {
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
}
"""Overrides of the tiny model's Qwen3 config (patchgym.models.tiny): 1m, 10m and 100m have about 1M,
10M and 104M parameters."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def noisy(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 1e-3 * torch.randn(t.shape, generator=generator) for name, t in tensors.items()}


# -- raw: two processes, rank 0 broadcasts, rank 1 receives -------------------------------------
def raw_rank(rank: int, port: int, model: Path, rounds: int) -> None:
    """One end of the raw broadcast (run as a subprocess); rank 0 prints each round's seconds as JSON."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = load_file(model / "model.safetensors")
    buffers = list(tensors.values()) if rank == 0 else [torch.empty_like(t) for t in tensors.values()]
    ack = torch.zeros(1)
    seconds = []
    dist.barrier()
    for _ in range(rounds):
        started = time.perf_counter()
        for tensor in buffers:
            dist.broadcast(tensor, src=0)
        dist.broadcast(ack, src=1)  # the round ends when the receiver has everything
        seconds.append(time.perf_counter() - started)
    if rank == 0:
        print(json.dumps(seconds), flush=True)
    dist.destroy_process_group()


def raw_broadcast(model: Path, rounds: int) -> list[float]:
    port = free_port()
    command = [sys.executable, __file__, "--raw-rank", "{rank}", "--port", str(port), "--model-dir", str(model)]
    command += ["--rounds", str(rounds)]
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [
        subprocess.Popen(
            [part.format(rank=rank) for part in command],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in ranks]
    if any(p.returncode for p in ranks):
        raise RuntimeError(f"the raw broadcast failed: {outputs}")
    return json.loads(outputs[0])


# -- stream: the Megatron trainer's streamed sync, in a process of its own ---------------------
def stream_rank(model: Path, rounds: int, bucket_bytes: int) -> None:
    """A one-rank Megatron trainer syncing `rounds` times into a receiving engine; prints JSON."""
    from patchgym.backends.trainer.megatron import MegatronTrainer
    from patchgym.launch.sync import WeightSync
    from patchgym.testing.weight_receiver import ReceiverEngine

    trainer = MegatronTrainer(model, sync_bucket_bytes=bucket_bytes, use_distributed_optimizer=False)

    async def run() -> list[dict[str, Any]]:
        engine = ReceiverEngine(weight_bucket_bytes=bucket_bytes)
        with tempfile.TemporaryDirectory() as tmp:
            sync = WeightSync(trainer, engine, mode="distributed", run_dir=Path(tmp))
            try:
                return [(await sync(version)).as_dict() for version in range(1, rounds + 1)]
            finally:
                await engine.aclose()
                await trainer.aclose()

    print(json.dumps(asyncio.run(run())), flush=True)


def stream(model: Path, rounds: int, bucket_bytes: int) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--stream-rank", "--model-dir", str(model), "--rounds", str(rounds)]
    command += ["--bucket-bytes", str(bucket_bytes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"the streamed sync failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# -- the three ways ---------------------------------------------------------------------------
async def timed(rounds: int, weights: dict[str, torch.Tensor], once: Callable[[dict, int], Any]) -> list[float]:
    """Seconds of `rounds` calls of `once(weights + noise, version)` (the noise is made outside the timing)."""
    seconds = []
    for index in range(rounds):
        fresh = noisy(weights, index)
        started = time.perf_counter()
        await once(fresh, index + 1)
        seconds.append(time.perf_counter() - started)
    return seconds


@contextmanager
def sglang_server(model: Path, logs: Path) -> Iterator[str]:
    venv = build_sglang_venv(progress=lambda m: console.print(m, highlight=False))
    settings = SGLangLaunchSettings(
        model_path=model,
        python=venv_python(venv),
        base_port=free_port(),
        device="cpu",
        context_length=512,
        max_total_tokens=4096,
        mem_fraction_static=None,
        dtype="float32",
        stubs_dir=stubs_path(venv),
    )
    servers = launch_sglang(settings, logs)
    try:
        yield servers[0].url
    finally:
        stop_servers(servers, settings.stop_grace_s)


def measure(name: str, model: Path, rounds: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    weights = load_file(model / "model.safetensors")
    row: dict[str, Any] = {"model": name, "params": sum(t.numel() for t in weights.values())}
    row["bytes"] = state_bytes(weights)
    console.print(f"{name}: raw gloo broadcast", highlight=False)
    row["raw"] = raw_broadcast(model, rounds)
    row["stream_bucket"] = max(1, int(row["bytes"] * args.bucket_fraction))
    console.print(f"{name}: stream: the Megatron trainer's streamed sync", highlight=False)
    reports = stream(model, rounds, row["stream_bucket"])
    row["stream"] = [r["seconds"] for r in reports]
    row["stream_peak"] = max(s["sender_extra_peak_bytes"] for r in reports for s in r["senders"])
    row["stream_buckets"] = reports[-1]["senders"][0]["buckets"]
    row["stream_formed"] = [r["groups_formed"] for r in reports]
    if not args.sglang:
        return row
    bucket_bytes = args.bucket_mb << 20
    checkpoint = work / f"{name}-checkpoint"  # config and tokenizer once; each round writes the weights
    shutil.copytree(model, checkpoint)
    with sglang_server(model, work / f"{name}-logs") as url:
        asyncio.run(into_sglang(url, weights, checkpoint, rounds, bucket_bytes, row))
    console.print(f"{name}: tensor: state dict into the embedded engine", highlight=False)
    asyncio.run(into_embedded(model, weights, rounds, row))
    return row


async def into_sglang(
    url: str, weights: dict, checkpoint: Path, rounds: int, bucket_bytes: int, row: dict[str, Any]
) -> None:
    engine = SGLangEngine(url, max_context=256, weight_bucket_bytes=bucket_bytes)

    async def distributed(fresh: dict, version: int) -> None:
        await engine.update_weights(DistributedWeights(fresh, master_port=free_port()), version=version)

    async def disk(fresh: dict, version: int) -> None:
        started = time.perf_counter()
        save_file(fresh, checkpoint / "model.safetensors")
        row["disk_save"].append(time.perf_counter() - started)
        await engine.update_weights(checkpoint, version=version)

    try:
        console.print(f"{row['model']}: distributed into SGLang", highlight=False)
        row["distributed"] = await timed(rounds, weights, distributed)
        console.print(f"{row['model']}: disk: safetensors + SGLang update_weights_from_disk", highlight=False)
        row["disk_save"] = []
        row["disk"] = await timed(rounds, weights, disk)
    finally:
        await engine.aclose()


async def into_embedded(model: Path, weights: dict, rounds: int, row: dict[str, Any]) -> None:
    engine = EmbeddedEngine(model, max_context=256)

    async def tensor(fresh: dict, version: int) -> None:
        await engine.update_weights(fresh, version=version)

    try:
        row["tensor"] = await timed(rounds, weights, tensor)
    finally:
        await engine.aclose()


def steady(row: dict[str, Any], key: str) -> float:
    """Median seconds of `key`'s rounds after the warm-up."""
    return statistics.median(row[key][row["warmup"] :])


def json_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per way and model: the `--json` schema (see the module docstring)."""
    out = []
    for row in rows:
        raw = steady(row, "raw")
        for way in ("raw", "stream", "distributed", "tensor", "disk"):
            if way not in row:
                continue
            seconds = steady(row, way)
            out.append(
                {
                    "way": way,
                    "model": row["model"],
                    "params": row["params"],
                    "model_bytes": row["bytes"],
                    "bucket_bytes": row["stream_bucket"] if way == "stream" else None,
                    "buckets": row["stream_buckets"] if way == "stream" else None,
                    "sender_extra_peak_bytes": row["stream_peak"] if way == "stream" else None,
                    "seconds": seconds,
                    "first_s": row[way][0],
                    "gb_s": row["bytes"] / 1e9 / seconds,
                    "ratio_vs_raw": raw / seconds,
                }
            )
    return out


def report_stream(rows: list[dict[str, Any]]) -> None:
    table = Table(title="the Megatron streamed sync (medians after the warm-up; x = rate / raw rate)")
    for column in ("model", "params", "MB", "raw", "stream", "bucket MB", "buckets", "sender extra peak", "target"):
        table.add_column(column, justify="right")
    for row in rows:
        raw, mine = steady(row, "raw"), steady(row, "stream")
        ratio, peak, bucket = raw / mine, row["stream_peak"], row["stream_bucket"]
        want = 0.5 if row["params"] < 5e6 else 0.8
        verdict = "meets" if ratio >= want and peak <= 3 * bucket else "misses"
        table.add_row(
            row["model"],
            f"{row['params'] / 1e6:.1f}M",
            f"{row['bytes'] / 1e6:.1f}",
            f"{raw * 1e3:.1f} ms",
            f"{mine * 1e3:.1f} ms, {ratio:.2f}x",
            f"{bucket / 1e6:.2f}",
            str(row["stream_buckets"]),
            f"{peak / bucket:.2f} buckets",
            f"{verdict} (>= {want}x, <= 3 buckets)",
        )
    console.print(table)


def report(rows: list[dict[str, Any]]) -> None:
    title = "weight sync, steady state: medians after the warm-up (GB/s of the fp32 state dict; x = rate / raw rate)"
    table = Table(title=title)
    for column in ("model", "params", "MB", "raw", "distributed", "tensor", "disk (save + load)"):
        table.add_column(column, justify="right")
    for row in rows:
        gb = row["bytes"] / 1e9
        raw = steady(row, "raw")

        def cell(key: str, raw: float = raw, gb: float = gb, row: dict = row) -> str:
            s = steady(row, key)
            return f"{s:.3f} s, {gb / s:.2f} GB/s, {raw / s:.2f}x"

        disk = cell("disk") + f" (save {steady(row, 'disk_save'):.3f} s)"
        params = f"{row['params'] / 1e6:.1f}M"
        raw_cell = f"{raw:.3f} s, {gb / raw:.2f} GB/s"
        table.add_row(
            row["model"], params, f"{row['bytes'] / 1e6:.0f}", raw_cell, cell("distributed"), cell("tensor"), disk
        )
    console.print(table)
    for row in rows:
        first = ", ".join(f"{key} {row[key][0]:.3f} s" for key in ("raw", "distributed", "tensor", "disk"))
        console.print(f"{row['model']}: first round (warm-up, not in the medians): {first}", highlight=False)
        ratio = steady(row, "raw") / steady(row, "distributed")
        verdict = "meets" if ratio >= 0.5 else "misses"
        console.print(f"{row['model']}: distributed at {ratio:.2f}x the raw broadcast's rate ({verdict} >= 0.5x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per way, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1, help="first rounds per way, reported apart")
    parser.add_argument("--models", default="1m,10m,100m", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--bucket-mb", type=int, default=512, help="SGLangEngine weight_bucket_bytes, in MiB")
    parser.add_argument("--bucket-fraction", type=float, default=1 / 8, help="stream: bucket size / model size")
    parser.add_argument("--sglang", action="store_true", help="also the ways into a CPU SGLang server")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on the last line")
    parser.add_argument("--stream-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--raw-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_rank is not None:
        raw_rank(args.raw_rank, args.port, args.model_dir, args.rounds)
        return
    if args.stream_rank:
        stream_rank(args.model_dir, args.rounds, args.bucket_bytes)
        return
    handle_interrupts()  # Ctrl-C or SIGTERM (e.g. `timeout`) still stops the SGLang server
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            model = init_tiny_model(work / name, **MODELS[name])
            row = measure(name, model, args.warmup + args.rounds, args, work)
            rows.append({**row, "warmup": args.warmup})
    report_stream(rows)
    if args.sglang:
        report(rows)
    if args.json:
        print(json.dumps({"rows": json_rows(rows)}), flush=True)


if __name__ == "__main__":
    main()
