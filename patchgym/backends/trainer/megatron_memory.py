"""The Megatron trainer's memory settings: attention (`megatron_attention`), activation recompute, CPU
optimizer offload, and the token cap dense attention can hold.

- `recompute`: `none` keeps every layer's activations for the backward; `selective` recomputes the core
  attention in the backward (megatron-core's `recompute_granularity="selective"`, module `core_attn`);
  `full` keeps only each layer's input and recomputes the whole layer (`"full"`, method `uniform`, one
  layer per unit). Both run on the CPU as on a GPU.
- `optimizer_cpu_offload`: Adam's state and step on the host (megatron-core's `HybridDeviceOptimizer`,
  all of it: offload fraction 1); needs the distributed optimizer and a GPU, since without one the
  optimizer is on the host already.
- dense attention's scores grow with the square of the packed length: `check_dense_fits` refuses a
  `micro_batch_tokens` whose scores and mask alone exceed the device's memory, naming the settings.

Pure arithmetic and dictionaries: no torch, so `launch.memory` shares the dense arithmetic.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from patchgym.core.errors import ConfigError

Attention = Literal["varlen", "dense"]
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CONFIG: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
"""The `recompute` setting -> megatron-core `TransformerConfig` fields."""


def check_attention(attention: str) -> None:
    if attention not in get_args(Attention):
        raise ConfigError(f"attention: {attention!r} is not one of {', '.join(get_args(Attention))}")


def recompute_config(recompute: str) -> dict[str, Any]:
    """megatron-core's `TransformerConfig` fields for `recompute`."""
    if recompute not in RECOMPUTE_CONFIG:
        raise ConfigError(f"recompute: {recompute!r} is not one of {', '.join(get_args(Recompute))}")
    return dict(RECOMPUTE_CONFIG[recompute])


def offload_config(offload: bool, *, distributed_optimizer: bool, gpu: bool) -> dict[str, Any]:
    """megatron-core's `OptimizerConfig` fields for `optimizer_cpu_offload`."""
    if not offload:
        return {}
    if not gpu:
        raise ConfigError(
            "optimizer_cpu_offload: true needs a GPU: without one the optimizer's state is in host memory already; "
            "set trainer.options optimizer_cpu_offload: false"
        )
    if not distributed_optimizer:
        raise ConfigError(
            "optimizer_cpu_offload: true needs use_distributed_optimizer: true (megatron-core offloads the "
            "distributed optimizer's shard)"
        )
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True}


def dense_scores_bytes(heads: float, tokens: float, act_bytes: int) -> float:
    """One layer's saved [s, s] attention of `heads` heads under dense attention: the fp32 softmax, plus its
    copy in the activation dtype for 16-bit training."""
    return heads * tokens * tokens * (4 + act_bytes if act_bytes == 2 else 4)


def dense_mask_bytes(tokens: float) -> float:
    """One micro-batch's [s, s] bool block-causal mask."""
    return tokens * tokens


DENSE_BACKWARD_BYTES = 12
"""Bytes per head and [s, s] entry that one layer's dense-attention backward holds for a moment on top of the
saved scores: fp32 gradients of the softmax's output and input, and their product. Fitted to
benchmarks/long_context.py on CPU (fp32, 2 layers x 8 heads): dense minus varlen at 4K tokens measured
about 20 bytes per head and entry, which 2 layers x 4 saved + 12 + the mask's 1/8 give."""


def dense_attention_bytes(heads: float, tokens: float, act_bytes: int, layers: int) -> float:
    """What dense attention adds for one micro-batch: `layers` layers' saved scores, one layer's backward, the mask."""
    return (
        layers * dense_scores_bytes(heads, tokens, act_bytes)
        + DENSE_BACKWARD_BYTES * heads * tokens * tokens
        + dense_mask_bytes(tokens)
    )


def check_dense_fits(
    *, attention: str, tokens: int, heads: float, layers: int, act_bytes: int, device_bytes: float, device: str
) -> None:
    """With `attention: dense`, a `ConfigError` when one micro-batch of `tokens` needs more memory for its
    attention scores (`layers` layers of `heads` heads on this rank) and mask than `device` has."""
    if attention != "dense":
        return
    need = dense_attention_bytes(heads, tokens, act_bytes, layers)
    if need > device_bytes:
        raise ConfigError(
            f"attention: dense at micro_batch_tokens={tokens} needs about {need / 1e9:.1f} GB for the [s, s] "
            f"attention scores (saved, and one layer's backward) and mask of one micro-batch ({layers} layers x "
            f"{heads:g} heads), more than the {device_bytes / 1e9:.1f} GB of {device}: set trainer.options "
            "attention: varlen (memory linear in tokens), or lower micro_batch_tokens (and "
            "agent.max_tokens_per_trajectory, which must fit in it)"
        )
