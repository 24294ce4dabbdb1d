"""Lazy per-rank loading (`megatron_load`): each rank's part, read tensor by tensor from the safetensors
files, equals what converting the whole model and sharding it gives; a rank reads only its share."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from patchgym.backends.trainer.megatron_convert import Layout, shard  # noqa: E402
from patchgym.backends.trainer.megatron_load import INDEX_FILE, SafetensorsDir, read_shard  # noqa: E402
from patchgym.backends.trainer.megatron_moe import is_expert  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from tests.tiny_models import tiny_qwen3, tiny_qwen3_moe  # noqa: E402


def whole_model(directory: Path) -> tuple[Layout, dict[str, torch.Tensor]]:
    """The old way: every file into memory, the whole model converted."""
    from safetensors.torch import load_file

    hf: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        hf.update(load_file(path))
    layout = Layout(transformers.AutoConfig.from_pretrained(directory))
    return layout, layout.hf_to_mcore(hf)


def check_every_rank(directory: Path, tp: int, etp: int) -> list[int]:
    layout, full = whole_model(directory)
    read = []
    for rank in range(max(tp, etp)):

        def split(name: str, rank: int = rank) -> tuple[int, int]:
            return (etp, rank % etp) if is_expert(name) else (tp, rank % tp)

        with SafetensorsDir(directory) as weights:
            parts = dict(read_shard(weights, layout, {name: split(name) for name in full}))
            read.append(weights.bytes_read)
        assert set(parts) == set(full)
        for name, tensor in full.items():
            assert torch.equal(parts[name], shard(name, tensor, *split(name))), (name, rank)
    return read


def total_bytes(directory: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for p in directory.glob("*.safetensors") for t in load_file(p).values())


@pytest.mark.parametrize("tie", [False, True])
def test_dense_tp2_parts_equal_the_whole_model_sharded(tmp_path: Path, tie: bool) -> None:
    directory = tiny_qwen3(tmp_path / "m", tie=tie)
    read = check_every_rank(directory, tp=2, etp=2)
    assert max(read) < 0.8 * total_bytes(directory)  # a TP rank reads about half, not everything


def test_moe_parts_with_expert_tp_and_a_sharded_index(tmp_path: Path) -> None:
    directory = tiny_qwen3_moe(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / INDEX_FILE).is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    check_every_rank(sharded, tp=2, etp=2)


def test_only_the_wanted_experts_are_read(tmp_path: Path) -> None:
    directory = tiny_qwen3_moe(tmp_path / "m")
    layout, full = whole_model(directory)
    experts = [n for n in full if ".local_experts.0." in n]
    with SafetensorsDir(directory) as weights:
        dict(read_shard(weights, layout, dict.fromkeys(experts, (1, 0))))
        assert weights.bytes_read == sum(full[n].numel() * full[n].element_size() for n in experts)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = tiny_qwen3(tmp_path / "m")
    state = load_file(directory / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(directory / "model.safetensors"))
    layout, _ = whole_model(tiny_qwen3(tmp_path / "ref"))
    with SafetensorsDir(directory) as weights, pytest.raises(ConfigError, match="lack model.layers.1.self_attn.k_proj"):
        dict(read_shard(weights, layout, {"decoder.layers.1.self_attention.linear_qkv.weight": (1, 0)}))


def test_experts_in_transformers_fused_layout_on_disk(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from patchgym.backends.trainer.megatron_convert import fuse_experts

    directory = tiny_qwen3_moe(tmp_path / "m")
    config = transformers.AutoConfig.from_pretrained(directory)
    fused = fuse_experts(load_file(directory / "model.safetensors"), config.num_hidden_layers, config.num_experts)
    save_file({k: v.contiguous() for k, v in fused.items()}, str(directory / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(directory / "model.safetensors")
    check_every_rank(directory, tp=2, etp=2)
