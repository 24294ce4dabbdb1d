"""Peak memory and time of one Megatron train step on CPU at 2K-32K tokens per micro-batch, old attention beside new.

The old path is `attention: dense` (megatron-core's local attention with a [b, 1, s, s] block-diagonal causal
mask: memory quadratic in the packed length); the new one is `attention: varlen` (THD with cu_seqlens,
scaled-dot-product attention per sample: memory linear in tokens). Each point is its own process: it builds
a `MegatronTrainer` (one rank, a small but wide random Qwen3), clears the kernel's peak-RSS mark
(/proc/self/clear_refs), takes one SFT step on one micro-batch of that many tokens (by default one sample
filling it, the long-trajectory case; `--sample-tokens` packs shorter ones), and reads the peak (VmHWM).
`peak_mb` is that peak; `step_mb` is the peak minus the memory before the step (what the step itself
added). The old path runs only where what it adds by `launch.memory`'s estimate (`dense_estimate_mb`:
[s, s] scores, one layer's backward over them, the mask) fits in `--max-mb`; `dense_extra_mb` is what it
measurably added (old minus new step memory at the same tokens).

    python benchmarks/long_context.py [--tokens 2048 4096 ...] [--max-mb 4096] [--json]

With --json the last line is {"rows": [{"trainer": "megatron", "path": "old"|"new", "tokens": N,
"peak_mb": M, "step_s": S, ...}], "skipped": [...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from patchgym.backends.trainer.megatron_memory import dense_attention_bytes  # noqa: E402

MODEL = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=65536, rope_theta=10000.0,
)  # fmt: skip
"""Small but wide: 8 query heads (so dense attention's [s, s] scores are large), 2 layers, a small vocabulary."""
PATHS = {"old": "dense", "new": "varlen"}
TOKENS = (2048, 4096, 8192, 16384, 32768)
MB = 1 << 20


def make_model(directory: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**MODEL, tie_word_embeddings=False)).save_pretrained(directory)
    return directory


def dense_estimate_mb(tokens: int) -> float:
    """What the old path adds for one micro-batch by `launch.memory`'s arithmetic: [s, s] scores, backward, mask."""
    return dense_attention_bytes(MODEL["num_attention_heads"], tokens, 4, MODEL["num_hidden_layers"]) / MB


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def one_point(model: Path, attention: str, tokens: int, sample_tokens: int, threads: int) -> dict[str, Any]:
    """Build the trainer and take one step in this process: the measured point."""
    from patchgym.backends.trainer.megatron import MegatronTrainer
    from patchgym.core.batch import Sample, TrainBatch
    from patchgym.core.losses import SFTLoss

    trainer = MegatronTrainer(model, micro_batch_tokens=tokens, attention=attention, threads=threads, lr=1e-4)
    lengths = [sample_tokens] * (tokens // sample_tokens) + [tokens % sample_tokens] * bool(tokens % sample_tokens)
    samples = [
        Sample([(7 * i + 3 * j) % MODEL["vocab_size"] for j in range(n)], [0] + [1] * (n - 1))
        for i, n in enumerate(lengths)
    ]
    batch = TrainBatch(samples, micro_batch_tokens=tokens)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
    before = _status_kb("VmRSS")
    started = time.perf_counter()
    metrics = asyncio.run(trainer.train_step(batch, SFTLoss()))
    step_s = time.perf_counter() - started
    peak = _status_kb("VmHWM")
    asyncio.run(trainer.aclose())
    return {
        "trainer": "megatron",
        "path": next(k for k, v in PATHS.items() if v == attention),
        "attention": attention,
        "tokens": tokens,
        "samples": len(samples),
        "peak_mb": round(peak / 1024, 1),
        "step_mb": round((peak - before) / 1024, 1),
        "step_s": round(step_s, 3),
        "loss": metrics["loss"],
        "threads": threads,
    }


def measure(model: Path, attention: str, tokens: int, sample_tokens: int, threads: int) -> dict[str, Any]:
    """`one_point` in a fresh process (so each peak is its own), its row from the JSON it writes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        command = [sys.executable, __file__, "--one", str(model), attention, str(tokens), str(sample_tokens),
                   str(threads), str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{attention} at {tokens} tokens failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's peak over the same path's peak at half the tokens (`peak_ratio_vs_half`), where measured;
    on old rows, what dense attention measurably added (`dense_extra_mb`: old minus new step memory)."""
    by = {(r["path"], r["tokens"]): r for r in rows}
    for row in rows:
        half = by.get((row["path"], row["tokens"] // 2))
        if half is not None:
            row["peak_ratio_vs_half"] = round(row["peak_mb"] / half["peak_mb"], 3)
            row["step_mb_ratio_vs_half"] = round(row["step_mb"] / max(half["step_mb"], 1e-9), 3)
        new = by.get(("new", row["tokens"]))
        if row["path"] == "old" and new is not None:
            row["dense_extra_mb"] = round(row["step_mb"] - new["step_mb"], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--sample-tokens", type=int, default=0, help="tokens per sample (0: one sample per step)")
    parser.add_argument("--max-mb", type=float, default=4096, help="run the old path where its estimate fits")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, attention, tokens, sample_tokens, threads, out = args.one
        row = one_point(Path(model), attention, int(tokens), int(sample_tokens), int(threads))
        Path(out).write_text(json.dumps(row))
        return

    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        for tokens in args.tokens:
            for path, attention in PATHS.items():
                estimate = dense_estimate_mb(tokens)
                if attention == "dense" and estimate > args.max_mb:
                    skipped.append(
                        {"path": path, "tokens": tokens, "why": f"dense estimate {estimate:.0f} MB > --max-mb"}
                    )
                    continue
                row = measure(model, attention, tokens, args.sample_tokens or tokens, args.threads)
                if attention == "dense":
                    row["dense_estimate_mb"] = round(estimate, 1)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    add_ratios(rows)
    show(rows, skipped)
    if args.json:
        print(json.dumps({"rows": rows, "skipped": skipped}))


def show(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="one Megatron train step on CPU: peak memory by tokens per micro-batch")
    columns = ("path", "attention", "tokens", "peak MB", "step MB", "peak / half", "step s", "dense +MB", "est +MB")
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["path"], r["attention"], str(r["tokens"]), f"{r['peak_mb']:.0f}", f"{r['step_mb']:.0f}",
            str(r.get("peak_ratio_vs_half", "")), f"{r['step_s']:.2f}", str(r.get("dense_extra_mb", "")),
            str(r.get("dense_estimate_mb", "")),
        )  # fmt: skip
    for s in skipped:
        table.add_row(s["path"], "dense", str(s["tokens"]), "-", "-", "", "-", "", s["why"])
    Console(stderr=True).print(table)


if __name__ == "__main__":
    main()
