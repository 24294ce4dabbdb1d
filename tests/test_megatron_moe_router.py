"""megatron's MoE router without TransformerEngine: the fallback is installed on any device, not only
on the CPU (issue 28: on a GPU without TransformerEngine the first MoE forward raised NameError)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

PROGRAM = """
import torch
torch.cuda.is_available = lambda: True  # as on a GPU: the CPU shim stays out of the way
from megatron.core.transformer.moe import moe_utils
if hasattr(moe_utils, "te_general_gemm"):
    print("transformer-engine-present")
    raise SystemExit(0)
x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
try:
    moe_utils.router_gating_linear(x, w, None, torch.float32)
    raise SystemExit("the router ran without TransformerEngine before the fallback")
except NameError as exc:
    assert "te_general_gemm" in str(exc), exc
from patchgym.backends.trainer import mcore_cpu, megatron_moe
mcore_cpu.install()
assert not mcore_cpu._installed  # a GPU is reported: the CPU shim patched nothing
assert megatron_moe.router_gemm() == "torch"
out = moe_utils.router_gating_linear(x, w, None, torch.float32)
assert torch.equal(out, x @ w.t()), (out, x @ w.t())
out.sum().backward()
assert torch.allclose(w.grad, x.sum(0).expand(4, 8)) and x.grad is not None
assert megatron_moe.router_gemm() == "torch"  # idempotent
print("fallback-works")
"""


def test_the_router_falls_back_to_torch_without_transformer_engine_on_a_gpu() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "transformer-engine-present" in proc.stdout:
        pytest.skip("TransformerEngine is installed here: its GEMM is the router's")
    assert "fallback-works" in proc.stdout
