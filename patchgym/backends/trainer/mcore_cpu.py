"""Run megatron-core on a machine without a GPU (tests, dry runs on a laptop).

megatron-core 0.16 hard-codes CUDA in a few places: its RNG tracker, the RoPE frequencies
(`.to(torch.cuda.current_device())`), the default causal mask (`device="cuda"`), the device RNG state
activation recompute saves and restores, buffers in the
distributed optimizer and gradient clipping (`device='cuda'`, `param.type() ==
'torch.cuda.FloatTensor'`), the pipeline schedule's receive buffers and syncs
(`torch.cuda.current_device()`, `torch.cuda.synchronize()`), and three in mixture-of-experts
layers: the all-to-all token dispatcher creates a `torch.cuda.Stream` for its device-to-host
copies; the router calls `te_general_gemm`, a name defined only when TransformerEngine imports
(NameError without it, on any device: `megatron_moe.router_gemm`, which the trainer applies on
GPUs too); and the dispatcher turns its split sizes into host arrays only for CUDA
tensors, so on the CPU `all_to_all_single` gets tensors. `install()` redirects those to the
CPU, and `active()` is a torch function mode that rewrites CUDA devices to CPU while megatron
code runs. Both do nothing when a GPU is present: there megatron-core runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def needed() -> bool:
    """True when there is no usable GPU, so megatron-core needs the shim."""
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device="cuda"` arguments, `.cuda()` and `.to("cuda")` to the CPU.

    `Tensor.type()` of a CPU tensor reports the CUDA type name, which is what megatron's
    float32 checks compare against.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def install() -> None:
    """Patch megatron-core's CUDA-only entry points for the CPU (once; a no-op when a GPU exists)."""
    global _installed
    if _installed or not needed():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named RNG states kept as CPU generator states; `fork` swaps the CPU RNG."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"RNG state {name!r} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} was never added")
            with torch.random.fork_rng(devices=[]):
                torch.random.set_rng_state(self.states_[name])
                try:
                    yield
                finally:
                    self.states_[name] = torch.random.get_rng_state()

    torch.cuda.current_device = lambda: "cpu"  # used as a device argument throughout megatron
    torch.cuda.synchronize = lambda *args, **kwargs: None
    tracker = CpuRNGStatesTracker()
    for offset, name in enumerate(
        (
            mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
            mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        )
    ):
        tracker.add(name, 2718 + offset)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    # activation recompute saves and restores the device RNG around each recomputed part: the CPU has
    # none besides torch's own, which megatron saves separately
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tutils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _install_moe()
    _installed = True


def _install_moe() -> None:
    """The mixture-of-experts parts: no side stream, no TransformerEngine GEMM, host split sizes."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from patchgym.backends.trainer.megatron_moe import router_gemm

    router_gemm()  # the trainer does this on every device too

    def host_splits(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
        """CPU version of `_maybe_dtoh_and_synchronize`: split sizes as numpy arrays, nothing to sync."""
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()  # the constructor makes one only when unset
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_splits


class _NoStream:
    """Stands in for the dispatcher's CUDA side stream, which the CPU version never uses."""


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Run the enclosed megatron calls with CUDA devices rewritten to CPU (nothing with a GPU)."""
    if not needed():
        yield
        return
    install()
    with _CudaToCpu():
        yield
