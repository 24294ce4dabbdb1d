"""Attention over packed micro-batches in the Megatron trainer: `varlen` (memory linear in tokens) or `dense`.

A packed micro-batch is one row of samples end to end. With `attention: varlen` (the default) the row
goes through megatron-core as a THD sequence: `PackedSeqParams` carries the samples' `cu_seqlens`, RoPE
restarts at each sample (megatron's THD rotary), and the core attention (`VarlenCoreAttention`, in the
layer spec in place of megatron's `DotProductAttention`, which refuses packed sequences) runs causal
attention inside each sample and never builds a mask or an [s, s] score matrix:

- on a GPU with flash-attn installed, one `flash_attn_varlen_func` call over the whole row;
- elsewhere (the CPU, or a GPU without flash-attn), PyTorch's scaled-dot-product attention per sample,
  whose fused kernels (flash / memory-efficient) keep one log-sum-exp per head and token.

With `attention: dense` the row keeps megatron's local attention with a [b, 1, s, s] block-diagonal
causal mask: its scores and the mask grow with the square of the packed length (the path before
varlen; kept to compare against). Both give the same log-probs and gradients (tests/test_megatron_attention.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from patchgym.backends.trainer.megatron_memory import check_attention
from patchgym.core.errors import ConfigError


def block_causal_mask(sample_index: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is forbidden: other samples or the future (dense path)."""
    s = sample_index.shape[1]
    same = sample_index[:, :, None] == sample_index[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=sample_index.device).tril()
    return ~(same & causal)[:, None]


def cu_seqlens(sample_index: torch.Tensor) -> torch.Tensor:
    """int32 offsets of the samples in one packed row ([1, s] sample indices): a sample starts wherever
    the index changes. Padding (index -1) at the end is a segment of its own, which trains nothing."""
    row = sample_index.reshape(-1)
    starts = (torch.diff(row) != 0).nonzero().flatten() + 1
    zero = torch.zeros(1, dtype=starts.dtype, device=row.device)
    end = torch.full((1,), row.numel(), dtype=starts.dtype, device=row.device)
    return torch.cat([zero, starts, end]).to(torch.int32)


def packed_seq_params(sample_index: torch.Tensor) -> PackedSeqParams:
    """megatron-core's THD description of one packed row."""
    if sample_index.shape[0] != 1:
        raise ConfigError(f"varlen attention takes packed micro-batches of one row, not {sample_index.shape[0]}")
    offsets = cu_seqlens(sample_index)
    longest = int((offsets[1:] - offsets[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def model_inputs(t: dict[str, torch.Tensor], attention: str) -> dict[str, Any]:
    """The keyword arguments of `GPTModel.forward` for micro-batch tensors `t` under `attention`."""
    ids = t["input_ids"]
    if attention == "dense":
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # RoPE is relative
        return {"input_ids": ids, "position_ids": positions, "attention_mask": block_causal_mask(t["sample_index"])}
    return {
        "input_ids": ids,
        "position_ids": t["position_ids"],  # THD RoPE restarts at each cu_seqlens offset, as these do
        "attention_mask": None,
        "packed_seq_params": packed_seq_params(t["sample_index"]),
    }


def _flash_varlen() -> Any:
    """flash-attn's varlen kernel, or None where it is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


class VarlenCoreAttention(MegatronModule):
    """Causal attention inside each packed sample (THD: query [t, heads, dim], key/value [t, groups, dim]).

    Takes `DotProductAttention`'s constructor arguments, so it drops into megatron's layer spec.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ConfigError("varlen attention does not split sequences (context parallelism); use cp = 1")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """[t, heads * dim]: each token attends to itself and the earlier tokens of its sample."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ConfigError("varlen attention needs packed (THD) micro-batches with cu_seqlens")
        if attention_bias is not None:
            raise ConfigError("varlen attention takes no attention bias")
        dropout = self.dropout if self.training else 0.0
        offsets = packed_seq_params.cu_seqlens_q
        flash = _flash_varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
        if flash is not None:
            longest = packed_seq_params.max_seqlen_q
            out = flash(query, key, value, offsets, offsets, longest, longest, dropout, self.scale, causal=True)
            return out.reshape(query.shape[0], -1)
        # [t, heads, dim] -> [1, heads, t, dim], contiguous: SDPA's layout (with 3-D inputs, or strided ones,
        # torch 2.13's CPU SDPA falls back to the math kernel, which builds the [s, s] scores); one call per
        # sample, no mask
        q, k, v = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (query, key, value))
        bounds = offsets.tolist()
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout_p=dropout, is_causal=True, scale=self.scale,
                enable_gqa=True,
            )
            for s, e in zip(bounds, bounds[1:], strict=False)
        ]  # fmt: skip
        return torch.cat(parts, 2)[0].transpose(0, 1).reshape(query.shape[0], -1)


def with_attention(spec: Any, attention: str) -> Any:
    """`spec` (a layer spec, or a block spec of layer specs) with `VarlenCoreAttention` for `varlen`."""
    check_attention(attention)
    if attention == "dense":
        return spec
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = VarlenCoreAttention
    return spec
