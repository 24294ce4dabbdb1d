"""Trainer throughput, measured side by side.

1. Embedded trainer, packing vs padding: SFT steps on trajectories whose lengths vary 10x
   (log-uniform, as agent trajectories do), same micro-batch token budget; real (non-pad)
   tokens per second, medians over interleaved repeats, and the ratios of packing (with
   variable-length attention, and with transformers' block-diagonal mask) to the others.
2. Megatron trainer on CPU, TP=1 vs TP=2 (torchrun, gloo), for the record: CPU tensor
   parallelism pays for its all-reduces and is not expected to be faster here.

    python benchmarks/trainer.py [--repeats N] [--samples N] [--skip-megatron]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

VOCAB = 512
ROWS = 8
"""The fixed micro-batch size of the padded baseline without a token budget."""
VARLEN, BLOCK = "packed, varlen", "packed, block-diagonal mask"
PADDED, FIXED = "padded (budget)", f"padded ({ROWS} rows)"
LAYOUTS = {  # name: (packing, micro_batch_rows, attention)
    VARLEN: (True, None, "varlen"),
    BLOCK: (True, None, "sdpa"),
    PADDED: (False, None, "sdpa"),
    FIXED: (False, ROWS, "sdpa"),
}
RATIOS = [(VARLEN, PADDED), (VARLEN, BLOCK), (VARLEN, FIXED), (BLOCK, PADDED)]


def make_model(directory: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def trajectories(n: int, shortest: int, seed: int = 0) -> list:
    """Samples whose lengths are log-uniform in [shortest, 10 * shortest]; the first fifth is prompt."""
    from patchgym.core.batch import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(shortest), math.log(10 * shortest))))
        prompt = max(1, length // 5)
        out.append(Sample([rng.randrange(1, VOCAB) for _ in range(length)], [0] * prompt + [1] * (length - prompt)))
    return out


async def embedded(model: Path, repeats: int, samples: int, budget: int) -> dict[str, dict[str, float]]:
    from patchgym.backends.trainer.embedded import EmbeddedTrainer
    from patchgym.core.batch import TrainBatch
    from patchgym.core.losses import SFTLoss

    batch = trajectories(samples, budget // 10)
    trainers = {
        mode: EmbeddedTrainer(
            model, micro_batch_tokens=budget, packing=packing, micro_batch_rows=rows, attention=attention
        )
        for mode, (packing, rows, attention) in LAYOUTS.items()
    }
    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    for trainer in trainers.values():  # warm-up
        await trainer.train_step(TrainBatch(batch), SFTLoss())
    for _ in track(range(repeats), description="embedded packed vs padded", transient=True):
        for mode, trainer in trainers.items():
            times[mode].append((await trainer.train_step(TrainBatch(batch), SFTLoss()))["step_s"])
    real = sum(len(s) for s in batch)
    out = {}
    for mode, (packing, rows, _) in LAYOUTS.items():
        mbs = TrainBatch(batch, budget, packing, rows=rows).micro_batches()
        slots = sum(mb.shape[0] * mb.shape[1] for mb in mbs)
        step = statistics.median(times[mode])
        out[mode] = {"step_s": step, "tokens_per_s": real / step, "micro_batches": len(mbs), "fill": real / slots}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_worker(model: Path, out: Path, tp: int, repeats: int, samples: int, budget: int) -> None:
    """Runs under torchrun: rank 0 times SFT steps and writes the median."""
    from patchgym.backends.trainer.megatron import MegatronTrainer
    from patchgym.core.batch import TrainBatch
    from patchgym.core.losses import SFTLoss

    trainer = MegatronTrainer(model, tp=tp, micro_batch_tokens=budget)
    if trainer.rank != 0:
        trainer.follow()
        return

    async def drive() -> None:
        batch = TrainBatch(trajectories(samples, budget // 10))
        await trainer.train_step(batch, SFTLoss())
        steps = [(await trainer.train_step(batch, SFTLoss()))["step_s"] for _ in range(repeats)]
        await trainer.aclose()
        step = statistics.median(steps)
        out.write_text(json.dumps({"step_s": step, "tokens_per_s": batch.total_tokens / step}))

    asyncio.run(drive())


def megatron(model: Path, repeats: int, samples: int, budget: int) -> dict[str, dict[str, float]]:
    results = {}
    for tp in track((1, 2), description="megatron TP=1, TP=2", transient=True):
        out = Path(tempfile.mkdtemp()) / "result.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", __file__, "--megatron-worker", str(model), str(out), str(tp),
            "--repeats", str(repeats), "--samples", str(samples), "--budget", str(budget),
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            raise SystemExit(f"megatron TP={tp} failed:\n{proc.stderr[-3000:]}")
        results[f"TP={tp}"] = json.loads(out.read_text())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--budget", type=int, default=2048, help="micro-batch token budget")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--megatron-worker", nargs=3, metavar=("MODEL", "OUT", "TP"))
    args = parser.parse_args()
    if args.megatron_worker:
        model, out, tp = args.megatron_worker
        megatron_worker(Path(model), Path(out), int(tp), args.repeats, args.samples, args.budget)
        return
    console = Console()
    model = make_model(Path(tempfile.mkdtemp()) / "model")
    lengths = f"{args.budget // 10}-{args.budget} tokens (10x), {args.samples} trajectories"
    emb = asyncio.run(embedded(model, args.repeats, args.samples, args.budget))
    table = Table(
        "layout", "median step (s)", "real tokens/s", "micro-batches", "slot fill", title=f"embedded SFT, {lengths}"
    )
    for mode, r in emb.items():
        table.add_row(
            mode, f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", str(r["micro_batches"]), f"{r['fill']:.0%}"
        )
    console.print(table)
    for mode, base in RATIOS:
        console.print(f"{mode} / {base} tokens/s: {emb[mode]['tokens_per_s'] / emb[base]['tokens_per_s']:.2f}x")
    if not args.skip_megatron:
        meg = megatron(model, args.repeats, args.samples, args.budget)
        table = Table("megatron on CPU", "median step (s)", "tokens/s", title="megatron SFT, packed, gloo")
        for name, r in meg.items():
            table.add_row(name, f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}")
        console.print(table)
        console.print(f"TP=2 / TP=1 step time: {meg['TP=2']['step_s'] / meg['TP=1']['step_s']:.2f}x")


if __name__ == "__main__":
    main()
