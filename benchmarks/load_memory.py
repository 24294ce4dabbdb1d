"""Host memory of one Megatron rank loading its shard of HF weights: the old way beside the lazy one.

    python benchmarks/load_memory.py [--json] [--tp 2] [--pp 2] [--layers 8] [--hidden 1024] [--shard-mb 50]

A random Qwen3 of a few hundred MB (bf16, `--layers` x `--hidden`, vocabulary 32000) is saved in
several safetensors shards with an index. For every rank of a TPxPP layout, one process per
measurement (a clean peak) allocates the rank's parameters (bf16, its shard's shapes), then loads:

- `old`: what the trainer did before issue 29: every shard file into memory, the whole model
  converted to megatron tensors, this rank's parts cut out and copied;
- `new`: `megatron_load.load_params`, which reads only this rank's slices through the index.

Reported per rank and way: the rank's shard (MB), the peak resident memory above what the process
held once its parameters were allocated (sampled every 2 ms), bytes read from the files, seconds.
With `--json` the last line is `{"rows": [{"way", "tp_rank", "pp_rank", "shard_mb", "peak_extra_mb",
"read_mb", "load_s"}]}`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1024 * 1024


def make_model(directory: Path, layers: int, hidden: int, shard_mb: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=f"{shard_mb}MB")
    return directory


def rank_names(directory: Path, tp: int, pp: int, pp_rank: int) -> tuple[Any, dict[str, list[int]]]:
    """The layout and this pipeline stage's megatron tensors (full shapes), from the files' headers only."""
    import torch
    from transformers import AutoConfig

    from patchgym.backends.trainer.megatron_convert import Layout
    from patchgym.backends.trainer.megatron_load import SafetensorsDir

    layout = Layout(AutoConfig.from_pretrained(directory))
    with SafetensorsDir(directory) as weights:
        meta = {name: torch.empty(weights.shape(name), device="meta") for name in weights.files}
    full = layout.hf_to_mcore(meta)
    per = layout.hf.num_hidden_layers // pp
    mine = range(pp_rank * per, (pp_rank + 1) * per)

    def on_stage(name: str) -> bool:
        if name.startswith("decoder.layers."):
            return int(name.split(".")[2]) in mine
        if name.startswith("embedding."):
            return pp_rank == 0
        return pp_rank == pp - 1

    return layout, {name: list(t.shape) for name, t in full.items() if on_stage(name)}


class PeakRss:
    """The largest resident set size seen while in the block, sampled every 2 ms."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(directory: Path, way: str, tp: int, pp: int, tp_rank: int, pp_rank: int) -> dict[str, Any]:
    """One rank's load, in this process."""
    import gc

    import torch
    from safetensors.torch import load_file

    from patchgym.backends.trainer.megatron_convert import shard
    from patchgym.backends.trainer.megatron_load import load_params

    layout, shapes = rank_names(directory, tp, pp, pp_rank)
    params = {}
    for name, shape in shapes.items():
        part = shard(name, torch.empty(shape, device="meta"), tp, tp_rank)
        # filled, so that its pages are resident before the load (zeros may be untouched calloc pages)
        params[name] = torch.nn.Parameter(torch.full(part.shape, 1.0, dtype=torch.bfloat16), requires_grad=False)
    gc.collect()
    started = time.perf_counter()
    with PeakRss() as rss:
        base = rss.peak
        if way == "new":
            read = load_params(directory, layout, params, lambda _: (tp, tp_rank))
        else:
            hf: dict[str, torch.Tensor] = {}
            for path in sorted(directory.glob("*.safetensors")):
                hf.update(load_file(path))
            read = sum(t.numel() * t.element_size() for t in hf.values())
            full = layout.hf_to_mcore(hf)
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(shard(name, full[name], tp, tp_rank).to(param.dtype))
            del hf, full
    shard_bytes = sum(p.numel() * p.element_size() for p in params.values())
    return {
        "way": way, "tp_rank": tp_rank, "pp_rank": pp_rank, "shard_mb": round(shard_bytes / MB, 1),
        "peak_extra_mb": round((rss.peak - base) / MB, 1), "read_mb": round(read / MB, 1),
        "load_s": round(time.perf_counter() - started, 2),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-mb", type=int, default=50)
    parser.add_argument("--measure", nargs=4, metavar=("DIR", "WAY", "TP_RANK", "PP_RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.measure:
        directory, way, tp_rank, pp_rank = args.measure
        print(json.dumps(measure(Path(directory), way, args.tp, args.pp, int(tp_rank), int(pp_rank))))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="patchgym-load-") as tmp:
        model = make_model(Path(tmp) / "model", args.layers, args.hidden, args.shard_mb)
        files = list(model.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files) / MB
        print(f"model: {size:.0f} MB in {len(files)} safetensors files; layout TP{args.tp} x PP{args.pp}")
        for pp_rank in range(args.pp):
            for tp_rank in range(args.tp):
                for way in ("old", "new"):
                    command = [sys.executable, __file__, "--tp", str(args.tp), "--pp", str(args.pp), "--measure"]
                    done = subprocess.run(
                        [*command, str(model), way, str(tp_rank), str(pp_rank)],
                        capture_output=True, text=True, check=True,
                    )  # fmt: skip
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    from rich.console import Console
    from rich.table import Table

    table = Table("tp_rank", "pp_rank", "shard MB", "old: peak extra MB", "new: peak extra MB", "old read MB",
                  "new read MB", "old s", "new s", title="host memory of one rank's HF load")  # fmt: skip
    for old, new in zip(rows[::2], rows[1::2], strict=True):
        table.add_row(*(str(old[k]) for k in ("tp_rank", "pp_rank", "shard_mb", "peak_extra_mb")),
                      str(new["peak_extra_mb"]), str(old["read_mb"]), str(new["read_mb"]), str(old["load_s"]),
                      str(new["load_s"]))  # fmt: skip
    Console(width=140).print(table)
    if args.json:
        print(json.dumps({"model_mb": round(size, 1), "tp": args.tp, "pp": args.pp, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
