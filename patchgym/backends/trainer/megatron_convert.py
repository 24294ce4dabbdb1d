"""Hugging Face <-> megatron-core for the Llama / Qwen2 / Qwen3 / Qwen3-MoE family: config and weight names.

Megatron layout (local layer spec): `linear_qkv` holds, per query group, that group's query
heads then its key and value head; `linear_fc1` holds gate then up. Tensor parallelism splits
column-parallel weights (embedding, qkv, fc1, output) on dim 0, with fc1 split as gate and up
separately, and row-parallel weights (attention output, fc2) on dim 1; norms are replicated.

Mixture of experts (Qwen3-MoE): the router is `mlp.router.weight` (HF `mlp.gate.weight`), and
expert `e` is `mlp.experts.local_experts.{e}.linear_fc1/linear_fc2` (a SequentialMLP). Full
megatron names number experts globally; an expert-parallel rank holds a contiguous block of them
(`megatron_moe`). On disk HF stores each expert's `gate_proj`, `up_proj`, `down_proj`; in memory
transformers 5 fuses them into `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
`mlp.experts.down_proj` [E, H, I]. `hf_to_mcore` reads either; `mcore_to_hf` writes the on-disk,
per-expert names (what `from_pretrained` and SGLang load).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from patchgym.backends.trainer.parallel import ModelShape, check_experts, check_split
from patchgym.core.errors import ConfigError

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")


def rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    scaling = getattr(hf, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise ConfigError(f"RoPE scaling {rope_type!r} is not supported by the megatron trainer; use plain RoPE")
    theta = getattr(hf, "rope_theta", None) or params.get("rope_theta")
    if theta is None:
        raise ConfigError("the HF config has no rope_theta")
    return float(theta)


class Layout:
    """Shapes of one model's attention, from its HF config."""

    def __init__(self, hf: Any) -> None:
        if hf.model_type not in SUPPORTED:
            raise ConfigError(f"model type {hf.model_type!r} is not supported; use one of {', '.join(SUPPORTED)}")
        self.hf = hf
        self.shape = ModelShape.from_hf(hf.to_dict())
        self.heads, self.groups, self.experts = self.shape.heads, self.shape.kv_heads, self.shape.experts
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // self.heads
        self.qkv_bias = hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
        self.qk_norm = hf.model_type in ("qwen3", "qwen3_moe")
        if self.experts and (list(getattr(hf, "mlp_only_layers", []) or []) or hf.decoder_sparse_step != 1):
            raise ConfigError(
                "Qwen3-MoE with dense layers (mlp_only_layers or decoder_sparse_step != 1) is not supported by the "
                "megatron trainer; every layer must be a mixture of experts"
            )
        self.tied = bool(hf.tie_word_embeddings)
        if getattr(hf, "mlp_bias", False):
            raise ConfigError("MLP biases are not supported by the megatron trainer")

    def moe_settings(self, ep: int, etp: int = 1) -> dict[str, Any]:
        """TransformerConfig fields for the experts (none for a dense model)."""
        check_experts(self.shape, ep=ep, etp=etp)
        if not self.experts:
            return {}
        return {
            "num_moe_experts": self.experts,
            "moe_ffn_hidden_size": self.hf.moe_intermediate_size,
            "moe_router_topk": self.hf.num_experts_per_tok,
            "moe_router_score_function": "softmax",
            # HF: softmax over all experts, top-k, renormalised when norm_topk_prob; megatron's default
            # (top-k, then softmax over those) is the renormalised form, pre-softmax the other
            "moe_router_pre_softmax": not self.hf.norm_topk_prob,
            "moe_router_load_balancing_type": "none",  # HF's loss has no router term unless output_router_logits
            "moe_aux_loss_coeff": 0.0,
            "moe_router_dtype": "fp32",  # routing in float32 whatever the weights' dtype, like HF's softmax
            "moe_grouped_gemm": False,
            "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp,
        }

    def transformer_config(self, *, tp: int, pp: int, dtype: torch.dtype, ep: int = 1, etp: int | None = None) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        hf = self.hf
        check_split(self.shape, tp=tp, pp=pp, ep=ep, etp=etp)
        moe = self.moe_settings(ep, etp or tp)
        return TransformerConfig(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.moe_intermediate_size if self.experts else hf.intermediate_size,
            num_attention_heads=self.heads,
            num_query_groups=self.groups,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            tensor_model_parallel_size=tp,
            sequence_parallel=bool(self.experts) and tp > 1,  # megatron's MoE layers train with TP only so
            pipeline_model_parallel_size=pp,
            pipeline_dtype=dtype,
            variable_seq_lengths=True,  # packed micro-batches differ in shape: stages send shapes first
            moe_token_dispatcher_type="alltoall",  # no experts here; megatron refuses the default with the above
            calculate_per_token_loss=True,  # the trainer's loss is already normalised over the step
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            use_cpu_initialization=True,
            **moe,
        )

    # -- names and shapes ------------------------------------------------------------------
    def _qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int | None = None) -> torch.Tensor:
        """megatron's qkv from HF's q, k, v projections (of `groups` query groups: all, or a TP rank's)."""
        per, groups = self.heads // self.groups, groups or self.groups
        rest = q.shape[1:]
        q = q.reshape(groups, per * self.head_dim, *rest)
        k = k.reshape(groups, self.head_dim, *rest)
        v = v.reshape(groups, self.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per = self.heads // self.groups
        rest = qkv.shape[1:]
        grouped = qkv.reshape(self.groups, (per + 2) * self.head_dim, *rest)
        q, k, v = torch.split(grouped, [per * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)

    def hf_to_mcore(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full (unsharded) megatron tensors from an HF state dict."""
        out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"]}
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
        if not self.tied:
            out["output_layer.weight"] = hf_state["lm_head.weight"]
        for i in range(self.hf.num_hidden_layers):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            attn = h + "self_attn."
            out[m + "input_layernorm.weight"] = hf_state[h + "input_layernorm.weight"]
            out[m + "self_attention.linear_qkv.weight"] = self._qkv(
                *(hf_state[f"{attn}{p}_proj.weight"] for p in "qkv")
            )
            if self.qkv_bias:
                out[m + "self_attention.linear_qkv.bias"] = self._qkv(
                    *(hf_state[f"{attn}{p}_proj.bias"] for p in "qkv")
                )
            if self.qk_norm:
                out[m + "self_attention.q_layernorm.weight"] = hf_state[attn + "q_norm.weight"]
                out[m + "self_attention.k_layernorm.weight"] = hf_state[attn + "k_norm.weight"]
            out[m + "self_attention.linear_proj.weight"] = hf_state[attn + "o_proj.weight"]
            out[m + "pre_mlp_layernorm.weight"] = hf_state[h + "post_attention_layernorm.weight"]
            if self.experts:
                out.update(self._experts_to_mcore(hf_state, h, m))
                continue
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [hf_state[h + "mlp.gate_proj.weight"], hf_state[h + "mlp.up_proj.weight"]]
            )
            out[m + "mlp.linear_fc2.weight"] = hf_state[h + "mlp.down_proj.weight"]
        return out

    def _experts_to_mcore(self, hf_state: dict[str, torch.Tensor], h: str, m: str) -> dict[str, torch.Tensor]:
        out = {m + "mlp.router.weight": hf_state[h + "mlp.gate.weight"]}
        fused = hf_state.get(h + "mlp.experts.gate_up_proj")
        for e in range(self.experts):
            x, hx = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
            if fused is not None:  # transformers' in-memory layout
                out[x + "linear_fc1.weight"] = fused[e]
                out[x + "linear_fc2.weight"] = hf_state[h + "mlp.experts.down_proj"][e]
            else:  # the on-disk layout
                out[x + "linear_fc1.weight"] = torch.cat(
                    [hf_state[hx + "gate_proj.weight"], hf_state[hx + "up_proj.weight"]]
                )
                out[x + "linear_fc2.weight"] = hf_state[hx + "down_proj.weight"]
        return out

    def mcore_to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors (the names transformers and SGLang load) from full megatron tensors: of the
        whole model, or any part of it (one pipeline stage's, one tensor's)."""
        return {k: v for name, tensor in state.items() for k, v in self.tensor_to_hf(name, tensor).items()}

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors one full megatron tensor holds (none for a tied output layer), contiguous."""
        return {k: v.contiguous() for k, v in self._to_hf(name, tensor).items()}

    def _to_hf(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        whole = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "decoder.final_layernorm.weight": "model.norm.weight",
        }
        if name in whole:
            return {whole[name]: t}
        if name == "output_layer.weight":
            return {} if self.tied else {"lm_head.weight": t}
        match = _LAYER.fullmatch(name)
        if match is None:
            raise ConfigError(f"no HF tensor for the megatron tensor {name!r}")
        h, rest = f"model.layers.{match[1]}.", match[2]
        attn = h + "self_attn."
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]  # weight or bias
            return {f"{attn}{p}_proj.{kind}": x for p, x in zip("qkv", self._split_qkv(t), strict=True)}
        expert = _EXPERT.fullmatch(rest)
        mlp = f"{h}mlp.experts.{expert[1]}." if expert else h + "mlp."
        if rest.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2)
            return {mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up}
        if rest.endswith("linear_fc2.weight"):
            return {mlp + "down_proj.weight": t}
        simple = {
            "input_layernorm.weight": h + "input_layernorm.weight",
            "self_attention.q_layernorm.weight": attn + "q_norm.weight",
            "self_attention.k_layernorm.weight": attn + "k_norm.weight",
            "self_attention.linear_proj.weight": attn + "o_proj.weight",
            "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
            "mlp.router.weight": h + "mlp.gate.weight",
        }
        if rest not in simple:
            raise ConfigError(f"no HF tensor for the megatron tensor {name!r}")
        return {simple[rest]: t}


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc[12]\.weight")


def fuse_experts(hf_state: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """The per-expert (on-disk) HF tensors of a Qwen3-MoE in transformers' fused in-memory layout."""
    out = dict(hf_state)
    for i in range(layers):
        h = f"model.layers.{i}.mlp.experts."
        gate_up, down = [], []
        for e in range(experts):
            gate, up, d = (out.pop(f"{h}{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            gate_up.append(torch.cat([gate, up]))
            down.append(d)
        out[h + "gate_up_proj"], out[h + "down_proj"] = torch.stack(gate_up), torch.stack(down)
    return out


ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
COLUMN_PARALLEL = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This tensor-parallel rank's part of a full megatron tensor."""
    if tp == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if name.endswith(COLUMN_PARALLEL):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(ROW_PARALLEL):
        return full.chunk(tp, dim=1)[rank]
    return full


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's part (inverse of `shard`)."""
    if len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    if name.endswith(COLUMN_PARALLEL):
        return torch.cat(parts, dim=0)
    if name.endswith(ROW_PARALLEL):
        return torch.cat(parts, dim=1)
    return parts[0]
