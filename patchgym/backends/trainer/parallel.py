"""The Megatron trainer's parallel layout, checked on construction (as torchtitan's `ParallelDims`).

Dense layers split the ranks as tp x dp x pp (megatron's order tp-cp-ep-dp-pp, cp = 1): rank =
tp_rank + tp * (dp_rank + dp * pp_rank). Expert layers split the same ranks separately as
etp x ep x edp x pp (order tp-ep-dp-pp), so world / (pp * etp) must be a multiple of ep: 8 ranks
as TP4/EP8 need etp = 1. `check_split` checks a model's shape against the sizes (heads, layers,
vocabulary, experts). Pure arithmetic: no torch, no megatron, so `patchgym run --dry-run` can
check a layout anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from patchgym.core.errors import ConfigError

SIZES = ("tp", "pp", "dp", "ep", "etp")


@dataclass(frozen=True)
class MegatronLayout:
    """Tensor, pipeline, data, expert and expert-tensor parallel sizes of one trainer."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in SIZES:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: parallel sizes must be at least 1")
        world, pp, etp, ep = self.world, self.pp, self.etp, self.ep
        if world % (pp * etp) or (world // (pp * etp)) % ep:
            raise ConfigError(
                f"world size {world} (tp={self.tp} x pp={pp} x dp={self.dp}) does not split into expert layers of "
                f"pp={pp} x etp={etp} x ep={ep}: world / (pp * etp) must be a multiple of ep "
                "(lower etp, e.g. etp=1, or ep, or raise dp)"
            )

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> MegatronLayout:
        """`world` ranks as tp x pp, data parallel for the rest; experts over `etp` ranks (default tp)."""
        if min(tp, pp) < 1:
            raise ConfigError(f"tp={tp}, pp={pp}: parallel sizes must be at least 1")
        if world % (tp * pp):
            raise ConfigError(f"world size {world} is not divisible by tp * pp = {tp} * {pp}")
        return cls(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, etp=etp or tp)

    @classmethod
    def from_options(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        ep: int = 1,
        etp: int | None = None,
        world: int | None = None,
    ) -> MegatronLayout:
        """The megatron backend's layout: `dp` from its options, or from the ranks a launcher
        (torchrun) started (`world`), else 1."""
        if world is not None and dp is not None and tp * pp * dp != world:
            raise ConfigError(f"tp * pp * dp = {tp * pp * dp} but torchrun started {world} ranks")
        if world is not None:
            return cls.for_world(world, tp=tp, pp=pp, ep=ep, etp=etp)
        return cls(tp=tp, pp=pp, dp=1 if dp is None else dp, ep=ep, etp=etp or tp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers: world / (pp * etp * ep)."""
        return self.world // (self.pp * self.etp * self.ep)

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index in each of its groups: tp, dp, pp (dense layers); etp, ep, edp (experts)."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the world of {self.world} ranks")
        return {
            "tp": rank % self.tp,
            "dp": rank // self.tp % self.dp,
            "pp": rank // (self.tp * self.dp),
            "etp": rank % self.etp,
            "ep": rank // self.etp % self.ep,
            "edp": rank // (self.etp * self.ep) % self.expert_dp,
        }

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "world": self.world, "expert_dp": self.expert_dp}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that parallelism must divide."""

    heads: int
    kv_heads: int
    layers: int
    vocab: int
    experts: int = 0
    expert_ffn: int = 0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face `config.json` (or `PretrainedConfig.to_dict()`); experts for Qwen3-MoE."""
        heads = config["num_attention_heads"]
        moe = config.get("model_type") == "qwen3_moe"
        return cls(
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            layers=config["num_hidden_layers"],
            vocab=config["vocab_size"],
            # config.json says num_experts; transformers 5's to_dict() num_local_experts
            experts=(config.get("num_experts") or config.get("num_local_experts") or 0) if moe else 0,
            expert_ffn=(config.get("moe_intermediate_size") or 0) if moe else 0,
        )


def check_experts(shape: ModelShape, *, ep: int, etp: int) -> None:
    """Experts split evenly over `ep` ranks, each expert's FFN over `etp` ranks; ep = 1 for a dense model."""
    if not shape.experts:
        if ep != 1:
            raise ConfigError(f"expert parallelism ep={ep} needs a mixture-of-experts model; use ep=1")
        return
    if shape.experts % ep:
        raise ConfigError(f"num_experts={shape.experts} is not divisible by expert parallel size {ep}")
    if shape.expert_ffn % etp:
        size = shape.expert_ffn
        raise ConfigError(f"moe_intermediate_size={size} is not divisible by expert tensor parallel size {etp}")


def check_split(shape: ModelShape, *, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """`shape` splits as megatron needs: heads, query groups and vocabulary by tp, layers by pp, experts by ep/etp."""
    check_experts(shape, ep=ep, etp=etp or tp)
    for name, value in (("num_attention_heads", shape.heads), ("num_key_value_heads", shape.kv_heads)):
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by tensor parallel size {tp}")
    if shape.layers % pp:
        raise ConfigError(f"num_hidden_layers={shape.layers} is not divisible by pipeline parallel size {pp}")
    if shape.vocab % tp:
        raise ConfigError(f"vocab_size={shape.vocab} is not divisible by tensor parallel size {tp}")
