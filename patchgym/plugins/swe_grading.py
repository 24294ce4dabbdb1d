"""Log-based grading for SWE-bench-style instances, hardened against reward hacking.

`SWELogGrader` restores the test files from a fixed commit (the files the test patch touches
and every changed file that looks like a test or test configuration: edited ones revert,
added ones go away), applies the instance's test patch from a grading directory outside the
workspace, runs the test command, and records its exit code. The log is parsed with the
`swebench` package's parser for the repository (or a named one) and judged with its
`get_eval_tests_report` / `get_resolution_status`, so verdicts agree with the harness; without
`swebench` installed, patchgym's own pytest/unittest parsers and `resolve` are used.

Forgery defences beyond restoration: a non-zero exit with no failing test in the log is
`exit_code_mismatch` (printed PASSED lines cannot hide a failing run), git runs with hooks and
fsmonitor disabled. Not defended against: an agent that replaces git or the interpreter, or
that loads a forging pytest plugin through `addopts` in `setup.cfg`/`pyproject.toml` (those
files are not restored, since real fixes may change them).
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.grading import resolve
from patchgym.core.sandbox import Sandbox
from patchgym.core.tasks import Grade, Grader, TestStatus
from patchgym.core.test_reports import LOG_PARSERS

TEST_PATH_PATTERN = r"(^|/)(tests?|testing)/|(^|/)test_[^/]*$|_tests?\.py$|(^|/)(conftest\.py|pytest\.ini|tox\.ini)$"
"""Paths treated as tests or test configuration (POSIX ERE): changed ones are reverted before grading."""

SAFE_GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false"

StatusMap = dict[str, str]


@cache
def swebench_available() -> bool:
    """Whether the `swebench` package imports; the import leaves the root logger as it was
    (swebench calls `logging.basicConfig` on import)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import swebench.harness.grading  # noqa: F401
        import swebench.harness.log_parsers  # noqa: F401
        import swebench.harness.test_spec.python  # noqa: F401
    except ImportError:
        return False
    finally:
        root.handlers[:], root.level = handlers, level
    return True


SWEBENCH_PARSER_MODULES = ("python", "javascript", "go", "java", "rust", "ruby", "php", "c")


@cache
def _swebench_parser(name: str, repo: str) -> Callable[..., StatusMap]:
    if not swebench_available():
        raise ConfigError(f"log parser {name!r} needs the swebench package: pip install 'patchgym[swebench]'")
    from swebench.harness import log_parsers

    if name == "swebench":
        parser = log_parsers.MAP_REPO_TO_PARSER.get(repo)
        if parser is None:
            raise ConfigError(f"swebench has no log parser for repository {repo!r}; name one with log_parser")
        return parser
    for module in SWEBENCH_PARSER_MODULES:
        parser = getattr(getattr(log_parsers, module, None), name, None)
        if name.startswith("parse_log_") and callable(parser):
            return parser
    raise ConfigError(f"unknown log parser {name!r}: use pytest, unittest, swebench or a swebench parse_log_* name")


def check_log_parser(name: str, repo: str) -> None:
    """Raise `ConfigError` now if `name` cannot parse logs of `repo`."""
    if name not in LOG_PARSERS:
        _swebench_parser(name, repo)


def _test_spec(instance_id: str, repo: str, version: str, f2p: list[str], p2p: list[str]) -> Any:
    from swebench.harness.test_spec.test_spec import TestSpec

    return TestSpec(
        instance_id=instance_id,
        repo=repo,
        version=version,
        repo_script_list=[],
        eval_script_list=[],
        env_script_list=[],
        arch="x86_64",
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        language="py",
        docker_specs={},
        namespace=None,
    )


def parse_log(log: str, parser: str, *, repo: str = "", instance_id: str = "", version: str = "") -> StatusMap:
    """`{test: status}` from a test log with the named parser (see `SWELogGrader.log_parser`)."""
    if parser in LOG_PARSERS:
        return {name: str(status) for name, status in LOG_PARSERS[parser](log).items()}
    parse = _swebench_parser(parser, repo)
    return dict(parse(log, _test_spec(instance_id, repo, version, [], [])))


def judge(status_map: Mapping[str, str], f2p: list[str], p2p: list[str]) -> tuple[str, dict[str, Any]]:
    """(resolution, report): swebench's FULL/PARTIAL/NO and its tests report, or patchgym's rule."""
    if swebench_available():
        from swebench.harness.grading import get_eval_tests_report, get_resolution_status

        report = get_eval_tests_report(dict(status_map), {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})
        return get_resolution_status(report), report
    tests = {name: _status(value) for name, value in status_map.items()}
    resolved, summary = resolve(tests, f2p, p2p)
    return ("RESOLVED_FULL" if resolved else "RESOLVED_NO"), summary


def _status(value: str) -> TestStatus:
    try:
        return TestStatus(value)
    except ValueError:
        return TestStatus.FAILED


def restore_script(ref: str, files: tuple[str, ...], pattern: str = TEST_PATH_PATTERN) -> str:
    """Bash that resets `files` and every changed path matching `pattern` to commit `ref`."""
    listed = "".join(f"{path}\n" for path in files)
    return (
        f"set -u; ref={shlex.quote(ref)}\n"
        f'{SAFE_GIT} rev-parse -q --verify "$ref^{{commit}}" >/dev/null '
        '|| { echo "commit $ref is not in the repository"; exit 3; }\n'
        f'{{ {{ {SAFE_GIT} -c core.quotepath=off diff --name-only "$ref" -- ; '
        f"{SAFE_GIT} -c core.quotepath=off ls-files --others -- ; }} | grep -E {shlex.quote(pattern)}; "
        f"printf %s {shlex.quote(listed)}; }} | sort -u | while IFS= read -r f; do\n"
        '  [ -n "$f" ] || continue\n'
        f'  if {SAFE_GIT} cat-file -e "$ref:$f" 2>/dev/null; then {SAFE_GIT} checkout -q "$ref" -- "$f" || exit 4;\n'
        '  else rm -rf -- "$f"; fi\n'
        "done"
    )


def _listing(names: list[str], limit: int = 20) -> list[str]:
    return names[:limit] + ([f"... and {len(names) - limit} more"] if len(names) > limit else [])


@dataclass(frozen=True)
class SWELogGrader(Grader):
    """Grades a SWE-bench/SWE-smith instance by its test log; see the module docstring.

    `restore_ref` is the commit whose test files are authoritative. `test_command` runs in the
    workdir (environment activation included). `log_parser`: "swebench" (the package's parser
    for `repo`), a swebench `parse_log_*` name, or patchgym's "pytest"/"unittest".
    """

    instance_id: str
    repo: str
    version: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_command: str
    restore_ref: str
    test_files: tuple[str, ...] = ()
    test_patch: str = ""
    log_parser: str = "swebench"
    timeout_s: float = 1800.0
    max_log_bytes: int = 4_000_000

    def __post_init__(self) -> None:
        check_log_parser(self.log_parser, self.repo)

    async def grade(self, sandbox: Sandbox) -> Grade:
        started = time.perf_counter()
        details: dict[str, Any] = {}
        made = await sandbox.exec('mktemp -d "${TMPDIR:-/tmp}/patchgym-grade.XXXXXXXXXX"', timeout_s=60)
        grade_dir = made.stdout.strip()
        if not made.ok or not grade_dir:
            return _zero("grading_setup_failed", details, made.output)
        restored = await sandbox.exec(restore_script(self.restore_ref, self.test_files), timeout_s=300)
        if not restored.ok:
            return _zero("test_restore_failed", details, restored.output)
        if self.test_patch:
            patch_path = f"{grade_dir}/test.patch"
            await sandbox.write_file(patch_path, self.test_patch)
            applied = await sandbox.exec(f"{SAFE_GIT} apply -v {shlex.quote(patch_path)}", timeout_s=120)
            if not applied.ok:
                return _zero("test_patch_failed", details, applied.output)
        run = await sandbox.exec(
            f"( {self.test_command} ) 2>&1", timeout_s=self.timeout_s, max_output_bytes=self.max_log_bytes
        )
        details.update(exit_code=run.exit_code, test_duration_s=round(run.duration_s, 3), log_tail=run.output[-2000:])
        grade = self.judge_log(run.output, run.exit_code, timed_out=run.timed_out, details=details)
        details["grade_duration_s"] = round(time.perf_counter() - started, 3)
        return grade

    def judge_log(
        self, log: str, exit_code: int | None, *, timed_out: bool = False, details: dict[str, Any] | None = None
    ) -> Grade:
        """The verdict on one test run's log and exit code (also usable on stored logs)."""
        details = {} if details is None else details
        if timed_out:
            return _zero("tests_timed_out", details)
        status_map = parse_log(log, self.log_parser, repo=self.repo, instance_id=self.instance_id, version=self.version)
        tests = {name: _status(value) for name, value in status_map.items()}
        if not tests:
            return _zero("no_test_results", details)
        if exit_code != 0 and not any(s in (TestStatus.FAILED, TestStatus.ERROR) for s in tests.values()):
            return _zero("exit_code_mismatch", details, tests=tests)
        resolution, report = judge(status_map, list(self.fail_to_pass), list(self.pass_to_pass))
        resolved = resolution == "RESOLVED_FULL"
        details.update(resolution=resolution, reason="resolved" if resolved else "tests_failed")
        details["report"] = {
            group: {k: _listing(list(v)) for k, v in outcome.items()} if isinstance(outcome, dict) else outcome
            for group, outcome in report.items()
        }
        return Grade(reward=1.0 if resolved else 0.0, resolved=resolved, tests=tests, details=details)


def _zero(
    reason: str, details: dict[str, Any], log: str = "", *, tests: Mapping[str, TestStatus] | None = None
) -> Grade:
    details["reason"] = reason
    if log:
        details.setdefault("log_tail", log[-2000:])
    return Grade(reward=0.0, resolved=False, tests=dict(tests or {}), details=details)
