"""Lazy per-rank loading of Hugging Face weights into the Megatron trainer.

Each rank reads only the tensors of its own shard, one at a time: the safetensors files are
opened with `safe_open` (through `model.safetensors.index.json` when there is one, else every
`*.safetensors` file's header), a tensor split by tensor parallelism on one HF source is read as
a slice (`get_slice`), an expert only where this expert-parallel rank holds it, a layer only on
the pipeline stage that builds it (an expert stored in transformers' fused layout: one expert's
rows of the fused tensor); tensors joined from several HF ones (qkv, gate/up) are joined
from the slices. Host memory at load is this rank's shard plus one tensor of it, not the model.

`hf_sources` names the HF tensors behind one megatron tensor and how they combine (the inverse of
`Layout.mcore_to_hf`, for one name; `Layout.hf_to_mcore` does the whole model at once).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from patchgym.backends.trainer.megatron_convert import COLUMN_PARALLEL, ROW_PARALLEL, Layout, shard
from patchgym.core.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts)


def hf_sources(layout: Layout, name: str) -> tuple[list[str], Callable[..., torch.Tensor] | None]:
    """The HF tensors that make the full megatron tensor `name`, and how to join them (None: it is
    the one source as it is)."""
    if name in _TOP:
        return [_TOP[name]], None
    match = _LAYER.match(name)
    if match is None:
        raise ConfigError(f"no HF source known for megatron tensor {name}")
    h, rest = f"model.layers.{match[1]}.", match[2]
    if rest in _SAME:
        return [h + _SAME[rest]], None
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"], layout._qkv
    if rest == "mlp.linear_fc1.weight":
        return [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], _cat
    expert = _EXPERT.match(rest)
    if expert is None:
        raise ConfigError(f"no HF source known for megatron tensor {name}")
    x = f"{h}mlp.experts.{expert[1]}."
    if expert[2] == "linear_fc1":
        return [x + "gate_proj.weight", x + "up_proj.weight"], _cat
    return [x + "down_proj.weight"], None


class SafetensorsDir:
    """The tensors of an HF model directory, read on demand: `read(name)` or a slice of it."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            files = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = {}
            for path in sorted(directory.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    files.update(dict.fromkeys(f.keys(), path))
        if not files:
            raise ConfigError(f"no *.safetensors weights in {directory}")
        self.files = files
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}
        self.bytes_read = 0
        """Bytes of tensor data read so far (what this rank took from disk into memory)."""

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise ConfigError(f"the HF weights in {self.directory} lack {name}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, part: tuple[int, int] = (1, 0)) -> torch.Tensor:
        """Tensor `name`, or with `dim` its `part` = (parts, index) chunk along that dimension."""
        handle = self._handle(name)
        parts, index = part
        if dim is None or parts == 1:
            tensor = handle.get_tensor(name)
        else:
            size = self.shape(name)[dim] // parts
            window = slice(index * size, (index + 1) * size)
            tensor = handle.get_slice(name)[window] if dim == 0 else handle.get_slice(name)[:, window]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def read_shard(
    weights: SafetensorsDir, layout: Layout, wanted: Mapping[str, tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(full megatron name, this rank's part) for each of `wanted` (name -> (tensor-parallel size,
    rank) of the group that splits it), read one tensor at a time, each HF source as the slice
    this rank needs: a column-parallel tensor's rows (for qkv, its query groups' rows of q, k and
    v; for fc1, its rows of gate and of up), a row-parallel tensor's columns."""
    for name, (tp, rank) in wanted.items():
        sources, join = hf_sources(layout, name)
        if sources[0] not in weights.files and ".mlp.experts.local_experts." in name:
            yield name, _fused_expert(weights, name, tp, rank)
            continue
        if name.endswith(ROW_PARALLEL):
            dim: int | None = 1
        elif name.endswith((*COLUMN_PARALLEL, "linear_fc1.weight")):
            dim = 0
        else:
            dim = None  # replicated: norms, the router
        parts = [weights.read(source, dim, (tp, rank)) for source in sources]
        if join is None:
            yield name, parts[0]
        else:  # qkv of this rank's query groups, or [gate; up] of its rows
            yield name, join(*parts, groups=layout.groups // tp) if ".linear_qkv." in name else join(*parts)


def _fused_expert(weights: SafetensorsDir, name: str, tp: int, rank: int) -> torch.Tensor:
    """An expert's part from transformers' fused layout (`mlp.experts.gate_up_proj` [E, 2I, H] with
    gate rows first, `mlp.experts.down_proj` [E, H, I]), one expert read."""
    match = _LAYER.match(name)
    expert = _EXPERT.match(match[2]) if match else None
    if match is None or expert is None:
        raise ConfigError(f"no HF source known for megatron tensor {name}")
    fused = f"model.layers.{match[1]}.mlp.experts." + ("gate_up_proj" if expert[2] == "linear_fc1" else "down_proj")
    index = int(expert[1])
    tensor = weights._handle(fused).get_slice(fused)[index : index + 1][0]
    weights.bytes_read += tensor.numel() * tensor.element_size()
    return shard(name, tensor, tp, rank).clone()


def load_params(
    directory: Path, layout: Layout, params: Mapping[str, torch.nn.Parameter], split: Callable[[str], tuple[int, int]]
) -> int:
    """Copy this rank's part of every HF tensor into `params` (full megatron name -> parameter);
    `split(name)` is (tensor-parallel size, rank) of the group that splits it. Returns bytes read."""
    with SafetensorsDir(directory) as weights, torch.no_grad():
        wanted = {name: split(name) for name in params}
        for name, part in read_shard(weights, layout, wanted):
            param = params[name]
            if part.shape != param.shape:
                raise ConfigError(f"{name}: HF gives {tuple(part.shape)}, the model wants {tuple(param.shape)}")
            param.copy_(part.to(param.dtype))
        return weights.bytes_read
