"""One supervised test run as graders use it: canary in, run, canary out, statuses and checks.

`supervised_run` picks the canary's place (beside the first expected test), runs the command
under the supervisor with the recorder loaded first (the supervisor writes the recorder and
removes the canary when the run is over, where it may), and returns a
`Supervised`: the test statuses from the records (never from the log, the exit status or a
report file) and, when the verdict cannot stand, the reason for a 0: `no_verdict`,
`tests_timed_out`, `canary` or `verdict_tampered`.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from patchgym.core.grading_shell import GradingRoom
from patchgym.core.tasks import TestStatus
from patchgym.core.verdict.canaries import Canary, make_canary
from patchgym.core.verdict.channel import Mode, NoVerdict, Verdict, channel_fds, prepare, run_supervised
from patchgym.core.verdict.judge import combine, test_file, without_unmarked_xfails


@dataclass
class Supervised:
    """The outcome of one supervised run; `failure` is the reason for a 0 ('' when none)."""

    tests: dict[str, TestStatus]
    log: str
    exit_code: int | None
    duration_s: float
    details: dict[str, Any] = field(default_factory=dict)
    failure: str = ""
    message: str = ""


def recorder_mode(command: str) -> Mode:
    """Which recorder a test command can host: 'unittest' for the bundled runner (`{runner}`),
    'pytest' for a pytest command, 'plain' (no recorder: the log is parsed) otherwise."""
    if "{runner}" in command:
        return "unittest"
    words = set(shlex.split(command.replace("{", " ").replace("}", " "), comments=False)) if command else set()
    return "pytest" if any(w == "pytest" or w.endswith(("/pytest", "/py.test")) for w in words) else "plain"


def canary_directory(expected: Sequence[str], mode: Mode) -> str:
    """Where the canary goes: the folder of the first expected test's file."""
    for test_id in expected:
        return posixpath.dirname(test_file(test_id, mode))
    return "tests"


async def supervised_run(
    room: GradingRoom,
    command: str,
    *,
    mode: Mode,
    expected: Sequence[str],
    timeout_s: float,
    max_log_bytes: int,
    canaries: bool = True,
    format_command: Any = None,
) -> Supervised:
    """Run `command` (after `format_command(recorder_path)` makes it final) and judge the records."""
    channel = channel_fds()
    canary: Canary | None = (
        make_canary(mode, canary_directory(expected, mode)) if canaries and mode != "plain" else None
    )
    prepared = prepare(room, mode, channel, canary)
    final = format_command(prepared.recorder) if format_command else command
    xfail_files = sorted({test_file(test_id, mode) for test_id in expected})
    if canary:  # written as the grader writes the test files (the tests' folder may not be the user's)
        await room.sandbox.write_file(canary.path, canary.source)
    try:
        verdict = await run_supervised(
            room,
            final,
            mode=mode,
            prepared=prepared,
            channel=channel,
            timeout_s=timeout_s,
            max_log_bytes=max_log_bytes,
            xfail_files=xfail_files,
            remove_after=(f"{room.sandbox.workdir}/{canary.path}",) if canary else (),
        )
    except NoVerdict as exc:
        return Supervised({}, exc.output, None, 0.0, {"verdict": {"mode": mode}}, "no_verdict", str(exc))
    return judge(verdict, canary, expected)


def judge(verdict: Verdict, canary: Canary | None, expected: Sequence[str] = ()) -> Supervised:
    """Statuses from the records, and the reason for a 0 if the verdict cannot stand. A canary
    that never ran is a `canary` failure only when every expected test passed (a runner that
    stops at the first failure may never reach it)."""
    tests, twice = combine(verdict.outcomes)
    tests, unmarked = without_unmarked_xfails(tests, verdict.xfail_files, verdict.mode)
    summary = verdict.summary()
    summary.update(reported_twice=twice[:20], unmarked_xfail=unmarked[:20])
    done = Supervised(tests, verdict.log, verdict.exit_code, verdict.duration_s, {"verdict": summary})
    wrong = ""
    if canary is not None:
        wrong, only_missing = canary.check(verdict.outcomes)
        summary["canary"] = {
            "must_pass": canary.outcomes(verdict.outcomes, canary.must_pass),
            "must_fail": canary.outcomes(verdict.outcomes, canary.must_fail),
        }
        done.tests = {t: s for t, s in tests.items() if not canary.is_canary(t)}
        if only_missing and not all(t in done.tests and done.tests[t].passing for t in expected):
            summary["canary"]["not_reached"], wrong = True, ""
    if verdict.timed_out:
        done.failure = "tests_timed_out"
    elif verdict.mode != "plain" and not verdict.began:
        done.failure, done.message = "no_verdict", "the recorder never started (the runner failed before any test)"
    elif wrong:
        done.failure, done.message = "canary", wrong
    elif verdict.problems:
        done.failure, done.message = "verdict_tampered", verdict.problems[0]
    return done
