"""The suite's CI rule: in CI a skip is a failure unless its reason is allowed (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SKIPPING = {
    "test_missing_package.py": (
        'import pytest\n\npytest.importorskip("patchgym_no_such_package")\n\n\ndef test_a():\n    pass\n'
    ),
    "test_skips.py": (
        "import pytest\n\n\n"
        "def test_plain_skip():\n    pytest.skip('not today')\n\n\n"
        "@pytest.mark.skipif(True, reason='live E2B test: set E2B_API_KEY to run it')\n"
        "def test_needs_a_cloud_key():\n    pass\n\n\n"
        "@pytest.mark.xfail(strict=True, reason='a known bug')\n"
        "def test_known_bug():\n    assert False\n\n\n"
        "def test_runs():\n    pass\n"
    ),
}


def run_suite(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    for name, text in SKIPPING.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA"]
    command += ["--continue-on-collection-errors", str(tmp_path)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ci", ["true", "false"])
def test_skips_fail_in_ci_unless_allowed(tmp_path: Path, ci: str) -> None:
    result = run_suite(tmp_path, ci)
    out = result.stdout
    assert "PASSED test_skips.py::test_runs" in out and "XFAIL test_skips.py::test_known_bug" in out
    assert re.search(r"SKIPPED \[1\] test_skips.py:\d+: live E2B test", out)
    if ci == "true":
        assert result.returncode != 0
        assert "FAILED test_skips.py::test_plain_skip - skipped in CI, where every test must run: not today" in out
        assert "ERROR test_missing_package.py - skipped in CI" in out and "patchgym_no_such_package" in out
    else:
        assert result.returncode == 0, out
        assert re.search(r"SKIPPED \[1\] test_skips.py:\d+: not today", out)
        assert "SKIPPED [1] test_missing_package.py" in out
