"""The `device` setting of the embedded engine and trainer, on CPU with a fake torch where a GPU is needed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from patchgym.backends.device import resolve_device
from patchgym.core.errors import ConfigError


def fake_torch(gpus: int, *, cuda: str | None = "12.8", hip: str | None = None) -> Any:
    """torch's device type and the parts of torch.cuda / torch.version that `resolve_device` reads."""
    return SimpleNamespace(
        device=torch.device,
        __version__="2.13.0",
        version=SimpleNamespace(cuda=cuda, hip=hip),
        cuda=SimpleNamespace(is_available=lambda: gpus > 0, device_count=lambda: gpus),
    )


def test_cpu_and_auto_without_a_gpu() -> None:
    cpu_only = fake_torch(0, cuda=None)
    assert resolve_device("cpu", cpu_only) == torch.device("cpu")
    assert resolve_device("auto", cpu_only) == torch.device("cpu")
    assert resolve_device(" CPU ", cpu_only) == torch.device("cpu")


def test_auto_takes_the_first_gpu() -> None:
    assert resolve_device("auto", fake_torch(2)) == torch.device("cuda", 0)


def test_cuda_and_cuda_n() -> None:
    two = fake_torch(2)
    assert resolve_device("cuda", two) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", two) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"torch sees 2 GPU\(s\) \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2", two)


def test_rocm_is_torchs_cuda_api_on_a_rocm_build() -> None:
    rocm = fake_torch(1, cuda=None, hip="6.4")
    assert resolve_device("rocm", rocm) == torch.device("cuda", 0)
    assert resolve_device("rocm:0", rocm) == torch.device("cuda", 0)
    assert resolve_device("cuda", rocm) == torch.device("cuda", 0)  # torch's own name works too
    with pytest.raises(ConfigError, match="needs a ROCm build of torch .this one is CUDA 12.8."):
        resolve_device("rocm", fake_torch(1))


def test_a_missing_gpu_says_what_torch_sees_and_the_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_device("cuda", fake_torch(0, cuda=None))
    message = str(caught.value)
    assert "torch sees no GPU" in message and "a CPU-only build" in message
    assert "install the GPU build of torch" in message and "device: cpu" in message


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cpu:1", "tpu", ""])
def test_bad_specs_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        resolve_device(spec, fake_torch(1))


def test_this_machines_torch() -> None:
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected


def test_engine_and_trainer_take_the_device(tiny_model_dir: Any) -> None:
    from patchgym.backends.inference.embedded import EmbeddedEngine
    from patchgym.backends.trainer.embedded import EmbeddedTrainer

    engine = EmbeddedEngine(str(tiny_model_dir), device="cpu", max_context=64)
    try:
        assert engine.settings()["device"] == "cpu"
        assert next(engine.model.parameters()).device == torch.device("cpu")
    finally:
        asyncio.run(engine.aclose())
    if not getattr(torch.version, "hip", None):  # a CPU or CUDA build of torch
        with pytest.raises(ConfigError, match="device 'rocm'"):
            EmbeddedEngine(str(tiny_model_dir), device="rocm", max_context=64)
    trainer = EmbeddedTrainer(str(tiny_model_dir), device="auto")
    assert trainer.settings()["device"] == str(resolve_device("auto"))
    with pytest.raises(ConfigError, match="device 'gpu'"):
        EmbeddedTrainer(str(tiny_model_dir), device="gpu")
