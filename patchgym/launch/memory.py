"""GPU memory a run's processes need, estimated before anything starts (`patchgym run --dry-run`).

Pure arithmetic on the model's shape (`ModelDims`, from its `config.json`), the Megatron layout and
the trainer's settings (`TrainerMemorySettings`), and on an engine's launch settings:

- a trainer rank: parameters (bf16 or fp32), gradients (megatron's fp32 gradient buffer),
  the optimizer (Adam's two moments, plus fp32 main parameters for bf16; split over the data-parallel
  ranks of each parameter with the distributed optimizer: dense over dp, experts over expert dp;
  on the host with `optimizer_cpu_offload`), activations of one micro-batch of `micro_batch_tokens`
  (per layer: the saved inputs, Q/K/V and context, each routed token's expert activations, and
  the attention's own: the [s, s] scores per head with `attention: dense`, plus one layer's backward
  over them, linear in tokens with `varlen`; `recompute` keeps less; the first pipeline stage holds pp
  micro-batches in flight),
  the logits of the loss (fp32 copies for the log-probs and the entropy), the weight-sync buffers
  (three buckets of `sync_bucket_bytes`), and a fixed allowance for the runtime (CUDA/HIP context,
  NCCL buffers).
- an engine: its weights per GPU and the KV cache SGLang reserves with `mem_fraction_static`,
  in tokens.

An estimate is a `MemoryEstimate`, checked against its device's memory by `check_fits`, which
names the largest part and the setting that shrinks it. Routing is assumed balanced between
experts; the estimate is approximate (tens of percent), not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from patchgym.backends.trainer.megatron_memory import (
    DENSE_BACKWARD_BYTES,
    Attention,
    Recompute,
    dense_mask_bytes,
    dense_scores_bytes,
)
from patchgym.backends.trainer.parallel import MegatronLayout, ModelShape
from patchgym.core.errors import ConfigError

GB = 1e9
RUNTIME_BYTES = 4 * GB
"""Allowance per GPU process for the CUDA/HIP context, NCCL/RCCL buffers and the allocator's slack."""
SYNC_BUCKETS_HELD = 3
"""Buckets a rank holds at once during a streamed weight sync (gathering, converting, sending)."""
ESTIMATE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "micro_batch_tokens": 8192,
    "use_distributed_optimizer": True,
    "attention": "varlen",
    "recompute": "none",
    "optimizer_cpu_offload": False,
    "sync_bucket_bytes": 512 << 20,
}
"""The Megatron trainer options the estimate reads, with the values it assumes where a config sets none."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a model that its memory depends on (a Hugging Face `config.json`)."""

    shape: ModelShape
    hidden: int
    ffn: int
    head_dim: int
    topk: int = 0
    tied: bool = False
    dtype_bytes: int = 2
    """Bytes per weight of the checkpoint (`torch_dtype`): what an engine with `dtype: auto` loads."""

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelDims:
        try:
            shape = ModelShape.from_hf(config)
            hidden = config["hidden_size"]
            return cls(
                shape=shape,
                hidden=hidden,
                ffn=config.get("intermediate_size") or 4 * hidden,
                head_dim=config.get("head_dim") or hidden // shape.heads,
                topk=(config.get("num_experts_per_tok") or 0) if shape.experts else 0,
                tied=bool(config.get("tie_word_embeddings", False)),
                dtype_bytes=DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2),
            )
        except KeyError as exc:
            raise ConfigError(f"the model's config.json lacks {exc.args[0]!r}") from None

    def layer_params(self, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[float, float]:
        """Parameters of one decoder layer on one rank: (dense, experts)."""
        s, h, d = self.shape, self.hidden, self.head_dim
        attention = h * d * (2 * s.heads + 2 * s.kv_heads) / tp + 2 * h + 2 * d  # q, k, v, o; norms
        if s.experts:
            return attention + h * s.experts, s.experts / ep * 3 * h * s.expert_ffn / etp  # router; experts
        return attention + 3 * h * self.ffn / tp, 0.0

    def total_params(self) -> float:
        dense, experts = self.layer_params()
        embeddings = self.shape.vocab * self.hidden * (1 if self.tied else 2)
        return self.shape.layers * (dense + experts) + embeddings + self.hidden


@dataclass(frozen=True)
class TrainerMemorySettings:
    """The Megatron trainer's settings the estimate reads (`ESTIMATE_DEFAULTS` where unset), checked."""

    dtype: str = ESTIMATE_DEFAULTS["dtype"]
    micro_batch_tokens: int = ESTIMATE_DEFAULTS["micro_batch_tokens"]
    use_distributed_optimizer: bool = ESTIMATE_DEFAULTS["use_distributed_optimizer"]
    attention: Attention = ESTIMATE_DEFAULTS["attention"]
    recompute: Recompute = ESTIMATE_DEFAULTS["recompute"]
    optimizer_cpu_offload: bool = ESTIMATE_DEFAULTS["optimizer_cpu_offload"]
    sync_bucket_bytes: int = ESTIMATE_DEFAULTS["sync_bucket_bytes"]

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"trainer dtype {self.dtype!r}: the Megatron trainer trains in float32 or bfloat16")
        for name, kind in (("attention", Attention), ("recompute", Recompute)):
            if getattr(self, name) not in get_args(kind):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(get_args(kind))}")
        if self.micro_batch_tokens < 1 or self.sync_bucket_bytes < 1:
            raise ConfigError("micro_batch_tokens and sync_bucket_bytes must be at least 1")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TrainerMemorySettings:
        return cls(**{name: options[name] for name in ESTIMATE_DEFAULTS if options.get(name) is not None})

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class MemoryEstimate:
    """A process's GPU memory per GPU, by part (bytes), against its device's memory (None: unknown)."""

    parts: Mapping[str, float]
    device_bytes: float | None = None
    host: Mapping[str, float] = field(default_factory=dict)
    """Parts kept in host memory instead (bytes)."""
    facts: Mapping[str, Any] = field(default_factory=dict)
    """What the estimate assumed or derived (tokens, settings, KV tokens), for a reader."""

    def __post_init__(self) -> None:
        negative = {k: v for k, v in {**self.parts, **self.host}.items() if v < 0}
        if negative:
            raise ConfigError(f"a memory estimate cannot be negative: {negative}")
        if self.device_bytes is not None and self.device_bytes <= 0:
            raise ConfigError(f"device memory {self.device_bytes} must be positive")

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total <= self.device_bytes

    def largest(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k])

    def as_dict(self) -> dict[str, Any]:
        gb = lambda v: round(v / GB, 2)  # noqa: E731
        return {
            "parts_gb": {k: gb(v) for k, v in self.parts.items()},
            "total_gb": gb(self.total),
            "device_gb": None if self.device_bytes is None else gb(self.device_bytes),
            "fits": self.fits,
            "host_gb": {k: gb(v) for k, v in self.host.items()},
            **self.facts,
        }


def trainer_memory(
    dims: ModelDims, layout: MegatronLayout, settings: TrainerMemorySettings, rank: int, device_bytes: float | None
) -> MemoryEstimate:
    """Trainer rank `rank`'s estimate (see the module docstring)."""
    s, t, b = dims.shape, layout.tp, settings.act_bytes
    stage = layout.coords(rank)["pp"]
    first, last = stage == 0, stage == layout.pp - 1
    layers = s.layers // layout.pp
    dense_layer, expert_layer = dims.layer_params(tp=t, ep=layout.ep, etp=layout.etp)
    embedding = s.vocab * dims.hidden / t
    head = embedding * (not dims.tied or layout.pp > 1) + dims.hidden  # the output layer and the final norm
    dense = layers * dense_layer + embedding * first + head * last
    experts = layers * expert_layer
    bf16 = settings.dtype == "bfloat16"
    optimizer_bytes = 12 if bf16 else 8  # (fp32 main params +) Adam's two fp32 moments
    shards = (layout.dp, layout.expert_dp) if settings.use_distributed_optimizer else (1, 1)
    optimizer = optimizer_bytes * (dense / shards[0] + experts / shards[1])
    stage_bytes = dims.total_params() * b / layout.pp
    parts = {
        "parameters": (dense + experts) * (2 if bf16 else 4),
        "gradients": (dense + experts) * 4,
        "optimizer": 0.0 if settings.optimizer_cpu_offload else optimizer,
        "activations": _activations(dims, layout, settings, stage),
        "logits": settings.micro_batch_tokens * s.vocab / t * (b + 20) if last else 0.0,
        "weight sync": min(SYNC_BUCKETS_HELD * settings.sync_bucket_bytes, stage_bytes),
        "runtime": RUNTIME_BYTES,
    }
    host = {"optimizer": optimizer} if settings.optimizer_cpu_offload else {}
    facts = {
        "params": round(dense + experts),
        "tokens": settings.micro_batch_tokens,
        "attention": settings.attention,
        "recompute": settings.recompute,
    }
    return MemoryEstimate(parts, device_bytes, host, facts)


def _activations(dims: ModelDims, layout: MegatronLayout, settings: TrainerMemorySettings, stage: int) -> float:
    """One pipeline stage's saved activations at the peak (bytes): the layers' saved tensors for the
    micro-batches in flight (pp - stage under 1F1B), plus one layer's during its recompute."""
    s, h, d, t, b = dims.shape, dims.hidden, dims.head_dim, layout.tp, settings.act_bytes
    tokens = settings.micro_batch_tokens
    local = tokens / t  # sequence parallelism splits the tokens between the tensor-parallel ranks
    saved = 4 * h * b * local  # the two norms' inputs and outputs
    saved += (2 * s.heads + 2 * s.kv_heads) * d * b * tokens / t  # Q, K, V and the context
    if s.experts:  # each token's top-k copies: expert input and output, fc1 (gate, up) and SwiGLU outputs
        saved += local * dims.topk * (2 * h + 3 * s.expert_ffn / layout.etp) * b + local * s.experts * 8
    else:
        saved += 3 * dims.ffn * b * tokens / t
    # dense: the fp32 softmax and its output for the [s, s] scores of each head, one layer's backward over them
    # (megatron_memory.DENSE_BACKWARD_BYTES, fitted to measurement), and one [s, s] bool mask per micro-batch;
    # flash/varlen keeps one fp32 log-sum-exp per head and token
    dense = settings.attention == "dense"
    scores = dense_scores_bytes(s.heads / t, tokens, b) if dense else s.heads / t * tokens * 4
    backward = DENSE_BACKWARD_BYTES * s.heads / t * tokens * tokens if dense else 0.0
    masks = dense_mask_bytes(tokens) * (layout.pp - stage) if dense else 0.0
    held = (s.layers // layout.pp) * (layout.pp - stage)
    per_layer = saved + scores
    if settings.recompute == "full":  # each layer keeps its input; one layer is rebuilt at a time
        return held * h * b * local + per_layer + backward + masks
    if settings.recompute == "selective":  # the attention's own part is rebuilt, one layer at a time
        return held * saved + scores + backward + masks
    return held * per_layer + backward + masks


def engine_memory(
    dims: ModelDims,
    *,
    tp: int,
    dtype: str,
    mem_fraction_static: float | None,
    context_length: int,
    device_bytes: float | None,
) -> MemoryEstimate:
    """One engine's estimate per GPU: weights and the KV cache of `mem_fraction_static` of the GPU."""
    weight_bytes = DTYPE_BYTES.get(dtype, dims.dtype_bytes)
    weights = dims.total_params() * weight_bytes / tp
    kv_heads = max(1, dims.shape.kv_heads // tp)  # SGLang replicates KV heads when tp exceeds them
    kv_per_token = dims.shape.layers * kv_heads * dims.head_dim * 2 * weight_bytes
    facts: dict[str, Any] = {"kv_bytes_per_token": kv_per_token, "context_length": context_length}
    parts = {"weights": weights}
    if mem_fraction_static is not None and device_bytes is not None:
        reserved = mem_fraction_static * device_bytes
        parts["kv cache"] = max(0.0, reserved - weights)
        facts |= {"kv_tokens": int(parts["kv cache"] // kv_per_token), "mem_fraction_static": mem_fraction_static}
    return MemoryEstimate(parts, device_bytes, facts=facts)


def check_fits(name: str, estimate: MemoryEstimate, role: str) -> None:
    """A `ConfigError` when `estimate` exceeds its device, naming the largest part and what shrinks it;
    for an engine, also when its KV cache cannot hold one sequence of its context length."""
    facts = estimate.facts
    if role == "engine":
        weights = estimate.parts["weights"]
        if "mem_fraction_static" in facts and weights > facts["mem_fraction_static"] * (estimate.device_bytes or 0):
            raise ConfigError(
                f"{name}: its weights take {weights / GB:.1f} GB per GPU, more than mem_fraction_static="
                f"{facts['mem_fraction_static']} of the GPU's {(estimate.device_bytes or 0) / GB:.0f} GB: raise "
                "inference.options.launch.mem_fraction_static or launch.tp"
            )
        if "kv_tokens" in facts and facts["kv_tokens"] < facts["context_length"]:
            raise ConfigError(
                f"{name}: its KV cache holds {facts['kv_tokens']} tokens, fewer than one sequence of its context "
                f"length {facts['context_length']}: raise inference.options.launch.mem_fraction_static or launch.tp, "
                "or lower max_context"
            )
        return
    if estimate.fits is not False:
        return
    largest = estimate.largest()
    changes = [
        *(["attention: varlen"] if facts["attention"] == "dense" else []),
        *(
            ["recompute: selective or full"]
            if facts["recompute"] == "none"
            else ["recompute: full"] * (facts["recompute"] == "selective")
        ),
        "a lower micro_batch_tokens (and agent.max_tokens_per_trajectory)",
    ]
    advice = {
        "activations": f"activations of micro_batch_tokens={facts['tokens']} with attention: {facts['attention']} and "
        f"recompute: {facts['recompute']}; set trainer.options {', '.join(changes)}, or raise tp or pp",
        "optimizer": "the optimizer's state; set trainer.options optimizer_cpu_offload: true, or raise dp (the "
        "distributed optimizer splits it) or ep",
        "logits": f"the logits of micro_batch_tokens={facts['tokens']}; raise tp or lower micro_batch_tokens",
        "weight sync": "the weight-sync buffers; lower trainer.options sync_bucket_bytes",
    }.get(largest, "the weights and their gradients; raise tp, pp or ep")
    shown = ", ".join(f"{k} {v / GB:.1f}" for k, v in estimate.parts.items())
    raise ConfigError(
        f"{name} needs about {estimate.total / GB:.0f} GB of GPU memory ({shown} GB), its GPU has "
        f"{(estimate.device_bytes or 0) / GB:.0f} GB: the largest part is {advice}"
    )
