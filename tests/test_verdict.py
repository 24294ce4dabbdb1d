"""The verdict channel's parts (issue 27): records, canaries, outcome rules, the supervisor's kill.

The sandboxed runs use the `none` backend on small unittest projects (fast, no image); the
attacks through the env API on bwrap and Docker are in tests/red_team/test_verdict.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patchgym.core.grading_shell import GradingRoom
from patchgym.core.sandbox import SandboxBackend, SandboxSpec
from patchgym.core.tasks import TestStatus
from patchgym.core.verdict.canaries import make_canary
from patchgym.core.verdict.inside.supervisor import Records
from patchgym.core.verdict.judge import as_pytest_log, combine, without_unmarked_xfails
from patchgym.core.verdict.session import Supervised, recorder_mode, supervised_run
from tests.conftest import make_backend

P, F, E, S, X = TestStatus.PASSED, TestStatus.FAILED, TestStatus.ERROR, TestStatus.SKIPPED, TestStatus.XFAIL
KEY = b"k" * 32


def signed(seq: int, kind: str, test_id: str = "", phase: str = "", outcome: str = "", key: bytes = KEY) -> bytes:
    body = "\x1f".join((str(seq), kind, test_id, phase, outcome)).encode()
    mac = hmac.new(key, body, hashlib.sha256).hexdigest()
    record = {"seq": seq, "kind": kind, "id": test_id, "phase": phase, "outcome": outcome, "mac": mac}
    return json.dumps(record).encode() + b"\n"


def test_records_verify_under_the_key_in_sequence_and_before_the_end() -> None:
    records = Records(KEY, 100)
    records.feed(signed(1, "begin") + signed(2, "outcome", "t.a", "call", "failed"))
    records.feed(signed(3, "outcome", "t.a", "call", "passed", key=b"guessed"))  # forged
    records.feed(signed(2, "outcome", "t.b", "call", "passed"))  # replayed sequence number
    records.feed(b'{"not": "a record"}\n' + signed(3, "end"))
    records.feed(signed(4, "outcome", "t.c", "call", "passed"))  # after the end
    records.feed(signed(5, "begin") + signed(6, "outcome", "t.d", "call", "passed")[:20])  # a second session
    assert records.outcomes == [["t.a", "call", "failed"]]
    assert records.began and not records.ended
    assert [p.split(":")[0] for p in records.problems] == [
        "a record on the verdict channel does not verify (forged)",
        "records out of sequence",
        "a line on the verdict channel is not a record",
        "a record after the runner's end",
    ]


def test_phases_combine_to_the_worst_and_a_second_report_is_an_error() -> None:
    outcomes = [
        ("a", "setup", "passed"),
        ("a", "call", "passed"),
        ("a", "teardown", "passed"),
        ("b", "setup", "passed"),
        ("b", "call", "passed"),
        ("b", "teardown", "error"),
        ("c", "setup", "skipped"),
        ("d", "call", "failed"),
        ("d", "call", "passed"),
        ("e", "call", "xpass"),
        ("f", "setup", "passed"),
    ]
    tests, twice = combine(outcomes)
    assert tests == {"a": P, "b": E, "c": S, "d": E, "e": P, "f": E}
    assert twice == ["d"]


def test_an_expected_failure_counts_only_where_the_pristine_file_marks_one() -> None:
    tests = {"tests/t.py::test_a": X, "tests/u.py::test_b": X, "tests/t.py::test_c": P}
    kept, changed = without_unmarked_xfails(tests, ["tests/t.py"], "pytest")
    assert kept == {"tests/t.py::test_a": X, "tests/u.py::test_b": F, "tests/t.py::test_c": P}
    assert changed == ["tests/u.py::test_b"]
    unittest_ids = {"pkg.tests.test_c.C.test_d": X, "pkg.tests.test_e.C.test_f": X}
    assert without_unmarked_xfails(unittest_ids, ["pkg/tests/test_c.py"], "unittest")[0] == {
        "pkg.tests.test_c.C.test_d": X,
        "pkg.tests.test_e.C.test_f": F,
    }


def test_records_as_a_log_keep_swebench_names() -> None:
    from patchgym.plugins.swe_grading import parse_log

    tests = {"tests/t.py::test_a[x y]": P, "tests/t.py::test_b": F}
    assert parse_log(as_pytest_log(tests), "pytest") == {
        "tests/t.py::test_a[x": "PASSED",
        "tests/t.py::test_b": "FAILED",
    }


@pytest.mark.parametrize("style", ["unittest", "pytest"])
def test_canaries_pass_and_fail_as_they_must(tmp_path: Path, style: str) -> None:
    canary = make_canary(style, "tests")  # type: ignore[arg-type]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / canary.path).write_text(canary.source)
    if style == "unittest":
        argv = [sys.executable, "-m", "unittest", "-v", canary.path.removesuffix(".py").replace("/", ".")]
    else:
        argv = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", canary.path]
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    pass_name, fail_name = canary.must_pass.rsplit(".", 1)[-1], canary.must_fail.rsplit(".", 1)[-1]
    if style == "pytest":
        pass_name, fail_name = canary.must_pass.split("::")[-1], canary.must_fail.split("::")[-1]
        assert f"PASSED {canary.path}::{pass_name}" in out and f"FAILED {canary.path}::{fail_name}" in out
    else:
        assert re.search(rf"{pass_name} \(.*\) \.\.\. ok", out) and re.search(rf"{fail_name} \(.*\) \.\.\. FAIL", out)
        assert "Ran 2 tests" in out and "failures=1" in out


def test_canary_check_needs_each_run_right_and_tells_a_canary_never_reached() -> None:
    canary = make_canary("pytest", "tests")
    right = [(f"tests/{canary.must_pass}", "call", "passed"), (f"tests/{canary.must_fail}", "call", "failed")]
    assert canary.check(right) == ("", False)
    flipped = [right[0], (right[1][0], "call", "passed")]
    assert canary.check(flipped)[0] == "a test that must fail came out passed" and not canary.check(flipped)[1]
    assert canary.check(right + [flipped[1]])[0]  # a second run in which it passed
    assert canary.check([right[0]]) == ("a test that must fail came out missing", True)


def test_recorder_mode_follows_the_command() -> None:
    assert recorder_mode("{python} -s -E {runner} --report {report}") == "unittest"
    assert recorder_mode("python3 -m pytest -rA tests/x.py") == "pytest"
    assert recorder_mode("source env; /opt/bin/pytest --no-header -rA") == "pytest"
    assert recorder_mode("./tests/runtests.py --verbosity 2") == "plain"
    assert recorder_mode("bin/test -C --verbose sympy/core") == "plain"


# -- the supervisor in a real sandbox ---------------------------------------------------------

TEST_MODULE = """import os, unittest

class T(unittest.TestCase):
    def test_passes(self):
        pass

    def test_fails(self):
        {body}
        self.fail("honest failure")
"""
COMMAND = "{python} -s -E {runner} --start tests --top ."


@pytest.fixture
async def none_backend(tmp_path: Path) -> SandboxBackend:
    backend = make_backend("local-none", tmp_path)
    yield backend  # type: ignore[misc]
    await backend.aclose()


async def run_project(backend: SandboxBackend, tmp_path: Path, body: str) -> Supervised:
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "__init__.py").write_text("")
    (project / "tests" / "test_t.py").write_text(TEST_MODULE.format(body=body))
    async with await backend.create(SandboxSpec(workspace=project)) as sandbox:
        room = await GradingRoom.open(sandbox)
        return await supervised_run(
            room,
            COMMAND,
            mode="unittest",
            expected=("tests.test_t.T.test_passes", "tests.test_t.T.test_fails"),
            timeout_s=120,
            max_log_bytes=100_000,
            format_command=lambda recorder: COMMAND.format(python=room.python, runner=recorder),
        )


async def test_an_honest_run_records_each_test(none_backend: SandboxBackend, tmp_path: Path) -> None:
    run = await run_project(none_backend, tmp_path, "pass")
    assert run.failure == "" and run.tests == {"tests.test_t.T.test_passes": P, "tests.test_t.T.test_fails": F}
    assert run.details["verdict"]["canary"] == {"must_pass": ["passed"], "must_fail": ["failed"]}


FORGE_ON_EVERY_DESCRIPTOR = """for fd in map(int, os.listdir('/proc/self/fd')):
            line = '{"seq": 3, "kind": "outcome", "id": "tests.test_t.T.test_fails", "phase": "call", '
            line += '"outcome": "passed", "mac": "00"}\\n'
            try:
                if fd > 2:
                    os.write(fd, line.encode())
            except OSError:
                pass"""


async def test_lines_forged_on_the_channel_are_tampering(none_backend: SandboxBackend, tmp_path: Path) -> None:
    run = await run_project(none_backend, tmp_path, FORGE_ON_EVERY_DESCRIPTOR)
    assert run.failure == "verdict_tampered" and "forged" in run.message
    assert run.tests["tests.test_t.T.test_fails"] == F


LEAVE_A_DAEMON = """import subprocess, sys
        daemon = subprocess.Popen(['sleep', '600'], start_new_session=True, env={{}})
        open({pid_file!r}, 'w').write(str(daemon.pid))"""


async def test_processes_left_behind_are_killed_before_the_verdict(
    none_backend: SandboxBackend, tmp_path: Path
) -> None:
    pid_file = tmp_path / "daemon.pid"
    run = await run_project(none_backend, tmp_path, LEAVE_A_DAEMON.format(pid_file=str(pid_file)))
    assert run.failure == "" and run.details["verdict"]["killed_processes"] >= 1
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
