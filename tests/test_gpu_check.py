"""benchmarks/gpu_check.py without a GPU: its arguments, the skip, how a case's process becomes rows, the table.

The cases themselves run the real trainer: `python benchmarks/gpu_check.py --device-any` runs them on CPU
(minutes: not in the suite)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
assert spec is not None and spec.loader is not None
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)


def test_arguments_have_the_reference_slice_and_are_checked() -> None:
    args = gpu_check.parse_args([])
    assert args.tokens == (4096, 8192, 16384, 32768, 65536) and args.budget_s == 480
    assert args.slice_shape == {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 16,
                                "expert_ffn": 768, "topk": 8, "vocab": 151936}  # fmt: skip
    args = gpu_check.parse_args(["--tokens", "64,128", "--slice-shape", "hidden=64,vocab=512", "--cases", "slice"])
    assert args.tokens == (64, 128) and args.slice_shape["hidden"] == 64 and args.slice_shape["experts"] == 16
    for bad in (["--tokens", "8"], ["--cases", "huge"], ["--slice-shape", "width=3"], ["--budget-s", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_without_a_gpu_it_skips_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.gpu_missing().startswith("no GPU here: torch.cuda.is_available() is False")
    assert gpu_check.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rows"] == [] and "nothing was checked" in out["skipped"]
    assert gpu_check.main([]) == 0 and capsys.readouterr().out.startswith("skipped: no GPU here")


def test_a_case_process_becomes_rows_or_one_failed_row() -> None:
    rows = [gpu_check.row("slice", "train step 4096 tokens", None, 1.5, tokens=4096, peak_gb=12.0)]
    assert gpu_check.case_rows("slice", 0, "log line\n" + json.dumps({"rows": rows}) + "\n", "") == rows
    (failed,) = gpu_check.case_rows("tiny-bfloat16", 1, "", "Traceback\n  ...\nNameError: te_general_gemm\n")
    assert (
        failed["ok"] is False
        and failed["detail"].startswith("exit status 1:")
        and "te_general_gemm" in failed["detail"]
    )


def test_the_report_prints_every_row_and_fails_on_a_failed_check(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        gpu_check.row("tiny-float32", "log-probs vs transformers", True, 4.8e-7, "max |gap|"),
        gpu_check.row("tiny-bfloat16", "resume: step 4 as without", False, 0.82, "max |gap| after step 4"),
        gpu_check.row("slice", "train step 65536 tokens", None, "OOM", tokens=65536),
    ]
    console = Console(width=200, record=True)
    console.print(gpu_check.table(rows, "check"))
    text = console.export_text()
    assert "4.8e-07" in text and "FAILED" in text and "OOM" in text and "65536" in text
    assert gpu_check.report(rows, True, 12.0) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == rows
    assert gpu_check.report(rows[:1], False, 1.0) == 0
