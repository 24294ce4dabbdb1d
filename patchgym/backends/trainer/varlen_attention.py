"""Variable-length attention for packed rows: each sample attends to itself only, at sum(L_i^2) cost.

A packed row holds samples end to end with position ids restarting at 0 at each one. transformers'
own attention turns that into a block-diagonal (T x T) mask and computes the whole square; this
one cuts the row where the position ids restart and runs causal SDPA on each sample. Importing the
module registers it with transformers as `VARLEN` (attention function and mask function: packed
rows get no mask built at all); rows with a padding mask, or a cache, go to transformers' SDPA.
A loop over SDPA calls because, in torch 2.13 on CPU, SDPA has no kernel for jagged nested
tensors and flex_attention has no backward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN = "patchgym_varlen"


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sample in a row of position ids: one starts wherever a position is not the last + 1."""
    starts = [0, *((torch.diff(position_ids) != 1).nonzero().flatten() + 1).tolist()]
    return list(zip(starts, [*starts[1:], len(position_ids)], strict=True))


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per sample of each row ([batch, heads, T, dim] in, [batch, T, heads, dim] out)."""
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window"):
        raise NotImplementedError(f"{VARLEN} attention does not implement sliding windows")
    causal = partial(F.scaled_dot_product_attention, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True)
    rows = []
    for b, positions in enumerate(position_ids.expand(query.shape[0], -1)):
        q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        rows.append(torch.cat([causal(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in segments(positions)], 2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def varlen_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask without a padding mask (`varlen_attention` separates the samples itself); else SDPA's."""
    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention)
AttentionMaskInterface.register(VARLEN, varlen_mask)
