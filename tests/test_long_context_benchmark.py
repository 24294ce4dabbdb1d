"""benchmarks/long_context.py: a real run at small sizes (its --json line), and how rows get their ratios."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.processes import run_group

pytest.importorskip("megatron.core")
BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "long_context.py"
RUN_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 120)


def test_a_small_run_measures_both_paths_where_the_old_one_fits() -> None:
    """At 128 and 256 tokens with --max-mb 5: the old path's estimate (2.5 and 10 MB) fits at 128 only, the
    new path runs at both; the last line is the JSON, with each row's ratio to half its tokens."""
    command = [sys.executable, str(BENCHMARK), "--tokens", "128", "256", "--threads", "1", "--max-mb", "5", "--json"]
    proc = run_group(command, RUN_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {(r["path"], r["tokens"]): r for r in result["rows"]}
    assert set(rows) == {("old", 128), ("new", 128), ("new", 256)}
    assert [(s["path"], s["tokens"]) for s in result["skipped"]] == [("old", 256)]
    for row in rows.values():
        assert row["trainer"] == "megatron" and row["peak_mb"] > row["step_mb"] > 0 and row["step_s"] > 0
    new, old = rows["new", 256], rows["old", 128]
    assert new["peak_ratio_vs_half"] == pytest.approx(new["peak_mb"] / rows["new", 128]["peak_mb"], abs=1e-3)
    assert old["dense_extra_mb"] == pytest.approx(old["step_mb"] - rows["new", 128]["step_mb"], abs=0.2)
    assert old["loss"] == pytest.approx(rows["new", 128]["loss"], abs=1e-5)  # same model, same step
