"""Tiny random-weight causal LMs for trainer tests (built from a config: nothing is downloaded)."""

from __future__ import annotations

import random
from pathlib import Path

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, rope_theta=10000.0, attention_dropout=0.0,
)  # fmt: skip
"""Every tiny model's shape: GQA with 4 query and 2 KV heads of 16 dims over a 64-wide residual stream."""


def tiny_qwen3(directory: Path, *, seed: int = 0, layers: int = 2, tie: bool = False) -> Path:
    """A 2-layer Qwen3 (GQA, q/k-norm) with random weights, saved in HF format."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**SHAPE, num_hidden_layers=layers, tie_word_embeddings=tie)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def tiny_qwen3_moe(directory: Path, *, seed: int = 0, experts: int = 4, top_k: int = 2) -> Path:
    """A 2-layer Qwen3-MoE (every layer sparse, top-k of `experts`) with random weights, saved in HF format."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **SHAPE,
        moe_intermediate_size=32,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # the default init (std 0.02) gives near-equal router logits: float noise would pick experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def random_samples(n: int, *, seed: int = 0, low: int = 6, high: int = 40, advantages: bool = True):
    """Samples with a prompt (mask 0) then a response (mask 1), engine log-probs near -log(VOCAB)."""
    from patchgym.core.batch import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(low, high)
        prompt = rng.randint(1, max(1, length // 3))
        tokens = [rng.randrange(1, VOCAB) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        engine = [0.0] * prompt + [-4.56 + rng.uniform(-0.05, 0.05) for _ in range(length - prompt)]
        adv = (1.0 if i % 2 else -1.0) if advantages else 0.0
        out.append(Sample(tokens, mask, adv, engine, group_id=str(i // 4)))
    return out
