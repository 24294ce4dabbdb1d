"""Expert parallelism in the Megatron trainer: expert numbering and balanced micro-batches.

With expert parallel size `ep`, each rank of an expert-parallel group holds a contiguous block of
`num_experts / ep` experts, named `local_experts.0..` inside the rank; full (HF-convertible) names
number them globally. Tokens reach their experts through an all-to-all in every MoE layer, so all
ranks of an expert-parallel group must run the same number of forward passes: ranks that would
have fewer micro-batches get empty ones (no trained tokens, so no loss and no gradient;
`megatron_batching.rank_share`).
Megatron's MoE layers refuse to train with tensor parallelism unless sequence parallelism is on,
which splits each micro-batch's sequence between the TP ranks: sequences are padded to a multiple
of tp at the end (padding has sample index -1 and loss mask 0, so spans and losses are unchanged).
The local layer spec's torch norm refuses sequence parallelism, so `layer_spec` swaps in
`SequenceParallelNorm`, which marks its weight for megatron to sum its gradient over the TP ranks.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from patchgym.core.errors import ConfigError

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def is_expert(name: str) -> bool:
    return _LOCAL_EXPERT.search(name) is not None


def global_expert_name(name: str, ep_rank: int, local_count: int) -> str:
    """`name` with its local expert index replaced by the global one (unchanged for other tensors)."""
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{ep_rank * local_count + int(m[1])}.", name)


def renumber_expert(full_name: str, local_name: str, ep_rank: int, local_count: int) -> str:
    """`full_name` (this rank's expert) as the same local expert of expert-parallel rank `ep_rank`."""
    index = ep_rank * local_count + int(_LOCAL_EXPERT.search(local_name)[1])
    return _LOCAL_EXPERT.sub(f".mlp.experts.local_experts.{index}.", full_name)


def router_gemm() -> str:
    """Make megatron's MoE router work without TransformerEngine, on any device; the GEMM it uses
    ("transformer_engine" or "torch").

    megatron-core 0.16's router (`moe_utils.router_gating_linear`) tests `te_general_gemm is not
    None` to choose TransformerEngine's GEMM, but the name is only defined when TransformerEngine
    imports: without it the first MoE forward raises NameError. Defining it as None selects the
    `torch.mm` path megatron has for that case (the same routing, in `moe_router_dtype`).
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return "torch" if moe_utils.te_general_gemm is None else "transformer_engine"


def pad_sequence(t: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Micro-batch tensors ([b, s] each) padded at the end of the sequence to a multiple of `multiple`."""
    extra = -t["input_ids"].shape[1] % multiple
    if not extra:
        return t
    return {k: torch.nn.functional.pad(v, (0, extra), value=-1 if k == "sample_index" else 0) for k, v in t.items()}


class SequenceParallelNorm:
    """megatron's torch-norm module for sequence parallelism: each TP rank normalises its share of
    the tokens, so the weight is marked `sequence_parallel` and megatron sums its gradient over TP."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.normalization != "RMSNorm":
            raise ConfigError(f"sequence parallelism supports RMSNorm models, not {config.normalization}")
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(config: Any, experts: int, qk_norm: bool) -> Any:
    """The local GPT layer spec (MoE layers when `experts`); with sequence parallelism, a block spec for
    this pipeline stage whose norms support it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec(num_experts=experts or None, qk_layernorm=qk_norm, normalization="RMSNorm")
    if not config.sequence_parallel:
        return spec
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelNorm
    if qk_norm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelNorm)
