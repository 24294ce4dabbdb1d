"""The `device` setting of the embedded engine and trainer: cpu, cuda, cuda:N, rocm, rocm:N or auto.

ROCm builds of torch drive AMD GPUs through torch's CUDA API (`torch.cuda`, device type "cuda",
`torch.version.hip` set), so `rocm:N` is `cuda:N` on such a build and an error on any other.
`auto` takes the first GPU when torch sees one, else the CPU. A GPU that is not there is a
`ConfigError` that says what torch sees and how to get a GPU build.
"""

from __future__ import annotations

import re
from typing import Any

from patchgym.core.errors import ConfigError

DEVICES = "cpu, cuda, cuda:N, rocm, rocm:N or auto"
_SPEC = re.compile(r"^(cpu|auto|cuda|rocm)(?::(\d+))?$")


def _torch() -> Any:
    import torch

    return torch


def gpu_platform(torch: Any) -> str | None:
    """'rocm' or 'cuda' for a GPU build of torch, None for a CPU-only build."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    return "cuda" if getattr(torch.version, "cuda", None) else None


def resolve_device(spec: str, torch: Any = None) -> Any:
    """The `torch.device` that `spec` names on this machine (see the module docstring)."""
    torch = torch or _torch()
    match = _SPEC.match(str(spec).strip().lower())
    if match is None:
        raise ConfigError(f"device {spec!r} is not one of {DEVICES}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        if index is not None:
            raise ConfigError(f"device {spec!r}: the CPU takes no index; write cpu")
        return torch.device("cpu")
    if kind == "auto":
        return torch.device("cuda", int(index or 0))
    platform = gpu_platform(torch)
    if kind == "rocm" and platform != "rocm":
        raise ConfigError(
            f"device {spec!r} needs a ROCm build of torch (this one is {_build(torch)}): install torch from the "
            "ROCm index of pytorch.org's install selector, or write device: cuda (NVIDIA) or cpu"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {spec!r}: torch sees no GPU (torch {torch.__version__}, {_build(torch)}); on a GPU machine "
            "install the GPU build of torch (pip install torch; for ROCm the index URL from pytorch.org), or "
            "write device: cpu (or auto)"
        )
    count = torch.cuda.device_count()
    number = int(index or 0)
    if number >= count:
        raise ConfigError(f"device {spec!r}: torch sees {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", number)


def _build(torch: Any) -> str:
    platform = gpu_platform(torch)
    if platform == "rocm":
        return f"ROCm {torch.version.hip}"
    return f"CUDA {torch.version.cuda}" if platform == "cuda" else "a CPU-only build"


def describe_device(device: Any, torch: Any = None) -> str:
    """'cpu' or 'cuda:0 (NVIDIA H100 80GB HBM3)' for settings and logs."""
    torch = torch or _torch()
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"
