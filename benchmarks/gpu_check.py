"""A GPU smoke check of the Megatron trainer as `patchgym run` builds it, on one GPU, in at most ~8 minutes.

    python benchmarks/gpu_check.py [--json] [--budget-s 480] [--tokens 4096,8192,16384,32768,65536]

Each case runs in a process of its own (a clean device, clean peak-memory counters, megatron's
global state built once), through the trainer's own public API (`MegatronTrainer`: the class
`patchgym run`'s megatron backend builds, one rank):

- `tiny-float32`, `tiny-bfloat16`: a random 2-layer Qwen3-MoE (4 experts, top-2). The rank binds
  the GPU (its `device` setting); its log-probs match transformers' on the same weights; 3 GRPO
  steps give finite losses and change the weights; its HF export loads in transformers and gives
  the trainer's log-probs; a checkpoint taken after step 3, loaded by a new trainer, gives the
  same step 4 as the trainer that went on (the bf16 resume of issue 28).
- `slice`: one rank shaped like the reference's (hidden 2048, 32/4 heads of 128, 16 experts of 768,
  top-8, vocab 151936, bf16, `--slice-layers` layers): time and peak memory of one GRPO train
  step at each of `--tokens` (one sample of that length; stops at the first out-of-memory), next
  to the dry run's estimate for the same shape, and of a weight sync's gather and conversion to
  HF tensors (`weights()`).

Without a GPU it says so and exits 0 (`--json`: `{"skipped": "...", "rows": []}`). With `--json`
the last line is `{"device": ..., "rows": [{"case", "check", "ok", "value", "detail", ...}]}`.
`--device-any` runs the cases without a GPU too (the CPU path, for tests of this script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOKENS = (4096, 8192, 16384, 32768, 65536)
SLICE = {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 16, "expert_ffn": 768,
         "topk": 8, "vocab": 151936}  # fmt: skip
"""One rank's share of the reference (Qwen3-30B-A3B at EP8: 16 of 128 experts), the full vocabulary."""
TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 4, "expert_ffn": 32, "topk": 2,
        "vocab": 512}  # fmt: skip
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}
"""Largest |trainer - transformers| log-prob gap accepted (bf16: both sides round differently)."""


# -- the driver (CPU-side: arguments, the skip, the table) ------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (last line)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting cases after this many seconds")
    parser.add_argument("--tokens", type=_ints, default=TOKENS, help="train-step lengths of the slice, comma-separated")
    parser.add_argument("--slice-layers", type=int, default=2, help="decoder layers of the reference-shaped slice")
    parser.add_argument("--slice-shape", type=_shape, default=SLICE, help="KEY=N,... overrides of the slice's shape")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=["tiny-float32", "tiny-bfloat16", "slice"])
    parser.add_argument("--device-any", action="store_true", help="run without a GPU too (tests of this script)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in its own process
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.slice_layers < 1 or not args.tokens or min(args.tokens) < 16:
        parser.error("--budget-s and --slice-layers must be positive, --tokens at least 16 each")
    unknown = set(args.cases) - {"tiny-float32", "tiny-bfloat16", "slice"}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}: tiny-float32, tiny-bfloat16, slice")
    return args


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _shape(text: str) -> dict[str, int]:
    pairs = dict(item.split("=", 1) for item in text.split(",") if item.strip())
    unknown = set(pairs) - set(SLICE)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape keys {sorted(unknown)}; known: {', '.join(SLICE)}")
    return {**SLICE, **{k: int(v) for k, v in pairs.items()}}


def gpu_missing() -> str | None:
    """Why this machine cannot run the check (None: it has a GPU torch can use)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {getattr(torch.version, 'hip', None)})"
    return f"no GPU here: torch.cuda.is_available() is False for {build}; nothing was checked"


def row(case: str, check: str, ok: bool | None, value: Any = None, detail: str = "", **extra: Any) -> dict[str, Any]:
    """One line of the report (ok None: a measurement, not a pass/fail check)."""
    return {"case": case, "check": check, "ok": ok, "value": value, "detail": detail, **extra}


def table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """The rows as a rich table: case, check, result, value, detail."""
    from rich.table import Table

    shown = Table("case", "check", "result", "value", "detail", title=title)
    for r in rows:
        result = {True: "ok", False: "FAILED", None: "-"}[r["ok"]]
        value = r["value"]
        text = f"{value:.4g}" if isinstance(value, float) else "-" if value is None else str(value)
        shown.add_row(r["case"], r["check"], result, text, r["detail"])
    return shown


def run_case(args: argparse.Namespace, case: str, timeout_s: float) -> list[dict[str, Any]]:
    """`case` in a process of its own; its rows, or one failed row saying how it ended."""
    command = [sys.executable, __file__, "--case", case, "--tokens", ",".join(map(str, args.tokens))]
    command += ["--slice-layers", str(args.slice_layers), "--slice-shape", ",".join(f"{k}={v}" for k, v in
                args.slice_shape.items())]  # fmt: skip
    command += ["--device-any"] if args.device_any else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [row(case, "finished", False, detail=f"still running after {timeout_s:.0f} s (--budget-s)")]
    return case_rows(case, done.returncode, done.stdout, done.stderr)


def case_rows(case: str, returncode: int, stdout: str, stderr: str) -> list[dict[str, Any]]:
    """A case process's rows (its last stdout line), or a failed row with the end of its stderr."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        return json.loads(lines[-1])["rows"]
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return [row(case, "finished", False, detail=f"exit status {returncode}: {tail[-400:]}")]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.case:
        print(json.dumps({"rows": asyncio.run(CASES[args.case](args))}))
        return 0
    missing = None if args.device_any else gpu_missing()
    if missing is not None:
        print(json.dumps({"skipped": missing, "rows": []}) if args.json else f"skipped: {missing}")
        return 0
    started, rows = time.monotonic(), []
    for case in args.cases:
        left = args.budget_s - (time.monotonic() - started)
        if left <= 10:
            rows.append(row(case, "finished", False, detail="not started: --budget-s spent"))
            continue
        rows += run_case(args, case, left)
    return report(rows, args.json, time.monotonic() - started)


def report(rows: list[dict[str, Any]], as_json: bool, elapsed_s: float) -> int:
    """Print the table (and the JSON line); exit status 1 when a check failed."""
    from rich.console import Console

    device = device_name()
    Console().print(table(rows, f"patchgym GPU check on {device} ({elapsed_s:.0f} s)"))
    if as_json:
        print(json.dumps({"device": device, "elapsed_s": round(elapsed_s, 1), "rows": rows}))
    return 1 if any(r["ok"] is False for r in rows) else 0


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


# -- the cases (each in its own process) -------------------------------------------------------------
def hf_moe(directory: Path, shape: dict[str, int], layers: int, dtype: str, seed: int = 0) -> Path:
    """A random Qwen3-MoE of `shape` saved in HF format (router weights spread so top-k is not a float tie)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
        moe_intermediate_size=shape["expert_ffn"], num_hidden_layers=layers, num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], num_experts=shape["experts"],
        num_experts_per_tok=shape["topk"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, max_position_embeddings=131072, torch_dtype=dtype,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def samples(n: int, length: int, vocab: int, seed: int) -> list[Any]:
    """`n` samples of `length` tokens: a prompt (mask 0) then a response, alternating advantages."""
    import random

    from patchgym.core.batch import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = max(1, length // 4)
        tokens = [rng.randrange(1, vocab) for _ in range(length)]
        engine = [0.0] * prompt + [-math.log(vocab) + rng.uniform(-0.05, 0.05) for _ in range(length - prompt)]
        out.append(Sample(tokens, [0] * prompt + [1] * (length - prompt), 1.0 if i % 2 else -1.0, engine, group_id="0"))
    return out


def transformers_logprobs(directory: Path, batch: Any, dtype: str, device: str) -> list[list[float]]:
    """Per-token log-probs of each sample under the HF model in `directory` (entry 0 is 0.0, as the trainer's)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.no_grad():
        for sample in batch.samples:
            ids = torch.tensor([sample.token_ids], device=device)
            logits = model(ids).logits.float()[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append([0.0, *logp.tolist()])
    del model
    return out


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


async def tiny_case(args: argparse.Namespace, dtype: str) -> list[dict[str, Any]]:
    from patchgym.backends.trainer.megatron import MegatronTrainer
    from patchgym.core.batch import TrainBatch
    from patchgym.core.losses import GRPOLoss

    case, tolerance = f"tiny-{dtype}", LOGPROB_TOLERANCE[dtype]
    rows = []
    with tempfile.TemporaryDirectory(prefix="patchgym-gpu-check-") as tmp:
        model = hf_moe(Path(tmp) / "model", TINY, 2, dtype)
        batch = TrainBatch(samples(4, 48, TINY["vocab"], seed=1))
        options = {"dtype": dtype, "lr": 1e-3, "micro_batch_tokens": 256}
        trainer = MegatronTrainer(model, **options)
        device = trainer.settings()["device"]
        on_gpu = device.startswith("cuda")
        rows.append(row(case, "binds the GPU", on_gpu or args.device_any, device))
        before = await trainer.logprobs(batch)
        reference = transformers_logprobs(model, batch, dtype, device)
        rows.append(row(case, "log-probs vs transformers", gap(before, reference) <= tolerance, gap(before, reference),
                        f"max |gap| over {sum(map(len, before))} tokens, tolerance {tolerance}"))  # fmt: skip
        losses = [(await trainer.train_step(batch, GRPOLoss()))["loss"] for _ in range(3)]
        after = await trainer.logprobs(batch)
        moved = gap(before, after)
        ok = all(math.isfinite(x) for x in losses) and moved > 0
        rows.append(row(case, "3 GRPO steps", ok, moved, f"losses {', '.join(f'{x:.4f}' for x in losses)}; "
                        "value: largest log-prob change"))  # fmt: skip
        exported = await trainer.weights(export_to=Path(tmp) / "export")
        assert exported.path is not None
        loaded = transformers_logprobs(exported.path, batch, dtype, device)
        rows.append(row(case, "export loads in transformers", gap(after, loaded) <= tolerance, gap(after, loaded),
                        "max |gap| to the trainer's log-probs"))  # fmt: skip
        await trainer.save(Path(tmp) / "checkpoint")
        await trainer.train_step(batch, GRPOLoss())
        went_on = await trainer.logprobs(batch)
        await trainer.aclose()
        del trainer
        resumed = MegatronTrainer(model, **options)
        await resumed.load(Path(tmp) / "checkpoint")
        await resumed.train_step(batch, GRPOLoss())
        again = await resumed.logprobs(batch)
        await resumed.aclose()
        rows.append(row(case, "resume: step 4 as without", gap(went_on, again) <= tolerance * 0.01, gap(went_on, again),
                        "max |gap| after step 4, from the step-3 checkpoint vs straight on"))  # fmt: skip
    return rows


async def slice_case(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from patchgym.backends.trainer.megatron import MegatronTrainer
    from patchgym.backends.trainer.parallel import MegatronLayout
    from patchgym.core.batch import TrainBatch
    from patchgym.core.losses import GRPOLoss
    from patchgym.launch.memory import GB, ModelDims, TrainerMemorySettings, trainer_memory

    shape, layers, rows = args.slice_shape, args.slice_layers, []
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="patchgym-gpu-check-") as tmp:
        model = hf_moe(Path(tmp) / "model", shape, layers, "bfloat16")
        dims = ModelDims.from_hf(json.loads((model / "config.json").read_text()))
        trainer = MegatronTrainer(model, dtype="bfloat16", lr=1e-6, micro_batch_tokens=max(args.tokens))
        for tokens in sorted(args.tokens):
            trainer.micro_batch_tokens = tokens
            estimate = trainer_memory(
                dims, MegatronLayout(), TrainerMemorySettings(dtype="bfloat16", micro_batch_tokens=tokens), 0, None
            )
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                await trainer.train_step(TrainBatch(samples(1, tokens, shape["vocab"], seed=tokens)), GRPOLoss())
            except torch.cuda.OutOfMemoryError as exc:
                rows.append(row("slice", f"train step {tokens} tokens", None, "OOM", str(exc).splitlines()[0][:160],
                                tokens=tokens, estimate_gb=round(estimate.total / GB, 2)))  # fmt: skip
                break
            if cuda:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() / GB if cuda else None
            rows.append(row("slice", f"train step {tokens} tokens", None, step_s, "value: seconds",
                            tokens=tokens, step_s=round(step_s, 3), peak_gb=None if peak is None else round(peak, 2),
                            estimate_gb=round(estimate.total / GB, 2)))  # fmt: skip
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        weights = await trainer.weights()
        sync_s = time.perf_counter() - start
        size = sum(t.numel() * t.element_size() for t in (weights.state_dict or {}).values())
        extra = (torch.cuda.max_memory_allocated() - base) / GB if cuda else None
        rows.append(row("slice", "sync: gather + HF conversion", None, sync_s, f"{size / GB:.2f} GB of HF tensors",
                        sync_s=round(sync_s, 3), extra_peak_gb=None if extra is None else round(extra, 2)))  # fmt: skip
        await trainer.aclose()
    return rows


CASES = {
    "tiny-float32": lambda args: tiny_case(args, "float32"),
    "tiny-bfloat16": lambda args: tiny_case(args, "bfloat16"),
    "slice": slice_case,
}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
