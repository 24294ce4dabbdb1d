"""Log-based grading for SWE-bench-style instances, hardened against reward hacking.

`SWELogGrader` restores the test files from a fixed commit (every file that looks like a test
or test configuration, and the files the test patch touches: edited ones revert, added ones go
away), applies the instance's test patch from a grading directory outside the workspace, runs
the test command in the clean grading shell, and records its exit code. Restoration writes
each file from the commit's blob (`git cat-file blob`, replace refs off): no index flag
(assume-unchanged, skip-worktree), attributes filter or `git diff` of the sandbox decides what
is restored. The log is parsed with the `swebench` package's parser for the repository (or a
named one) and judged with its `get_eval_tests_report` / `get_resolution_status`, so verdicts
agree with the harness; without `swebench` installed, patchgym's own pytest/unittest parsers
and `resolve` are used.

Forgery defences beyond restoration: only the test run's own output is parsed (what the set-up
steps print, pip's lines among them, goes to a file of the grading directory); a test reported
twice keeps its worst status (a forged PASSED line after the real FAILED one does not count); a
non-zero exit with no failing test in the log is `exit_code_mismatch`. Graded in a fresh sandbox
(`FreshSandboxGrader`, the default), git and the interpreter are the task's, not the agent's;
in place they are only as honest as the agent's sandbox. The tamper check flags `addopts` and
plugin options the agent added to `setup.cfg`/`pyproject.toml`/`tox.ini`.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.grading import GradeFailure, ShellGrader, resolve, zero_grade
from patchgym.core.grading_shell import GradingRoom, GradingSetupError
from patchgym.core.sandbox import Sandbox
from patchgym.core.tasks import Grade, TestStatus
from patchgym.core.test_reports import LOG_PARSERS, worst
from patchgym.core.verdict.judge import as_pytest_log
from patchgym.core.verdict.session import recorder_mode, supervised_run

TEST_PATH_PATTERN = r"(^|/)(tests?|testing)/|(^|/)test_[^/]*$|_tests?\.py$|(^|/)(conftest\.py|pytest\.ini|tox\.ini)$"
"""Paths treated as tests or test configuration (POSIX ERE): changed ones are reverted before grading."""

SAFE_GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false"
RESTORE_GIT = f"{SAFE_GIT} --no-replace-objects -c core.attributesFile=/dev/null"
"""git for restoring test files: no hooks, no fsmonitor, no replace refs, no attributes file."""

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
    """`{test: status}` from a test log with the named parser (see `SWELogGrader.log_parser`).

    A test reported twice keeps its worst status: swebench's parsers keep the last line, so each
    line is also parsed on its own and the worse status wins.
    """
    if parser in LOG_PARSERS:
        return {name: str(status) for name, status in LOG_PARSERS[parser](log).items()}
    parse = _swebench_parser(parser, repo)
    spec = _test_spec(instance_id, repo, version, [], [])
    statuses = {name: _status(value) for name, value in parse(log, spec).items()}
    for line in log.splitlines():
        for name, value in parse(line, spec).items():
            statuses[name] = worst(statuses.get(name), _status(value))
    return {name: str(status) for name, status in statuses.items()}


def judge(
    status_map: Mapping[str, str], f2p: list[str], p2p: list[str], *, repo: str = ""
) -> tuple[str, dict[str, Any]]:
    """(resolution, report): swebench's FULL/PARTIAL/NO and its tests report, or patchgym's rule.

    As the harness does, the repositories in swebench's `FAIL_ONLY_REPOS` count a listed test as
    failing only when the log reports it failed."""
    if swebench_available():
        from swebench.harness.constants import FAIL_ONLY_REPOS, EvalType
        from swebench.harness.grading import get_eval_tests_report, get_resolution_status

        eval_type = EvalType.FAIL_ONLY if repo in FAIL_ONLY_REPOS else EvalType.PASS_AND_FAIL
        gold = {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}
        report = get_eval_tests_report(dict(status_map), gold, eval_type=eval_type)
        return get_resolution_status(report), report
    tests = {name: _status(value) for name, value in status_map.items()}
    resolved, summary = resolve(tests, f2p, p2p)
    return ("RESOLVED_FULL" if resolved else "RESOLVED_NO"), summary


def _status(value: str) -> TestStatus:
    try:
        return TestStatus(value)
    except ValueError:
        return TestStatus.FAILED


BYTECODE_PATTERN = r"(^|/)__pycache__/|\.py[co]$"
"""Python bytecode: removed from test paths even where the base commit ignores it (an unchecked
hash-based `.pyc` is imported without a look at the restored source beside it)."""


def restore_script(ref: str, files: tuple[str, ...], pattern: str = TEST_PATH_PATTERN) -> str:
    """Bash that resets every test path (matching `pattern`) and `files` to their blobs at commit
    `ref`: files at `ref` are written from the blob (with its executable bit, or as the symbolic
    link it is), files absent there are deleted.

    A symbolic link standing where `ref` has a test folder is removed first (the files would be
    written through it, and what else its target holds would stay). Untracked files that the
    `.gitignore` files of `ref` ignore (build output such as
    `*.egg-info` or a compiled extension) are left alone, except Python bytecode. The rules are
    read from the commit's blobs into a scratch repository, never from the working tree: an
    ignore line the agent adds cannot hide a file it planted.
    """
    listed = "".join(f"{path}\n" for path in files)
    git = RESTORE_GIT
    return (
        f"set -u; ref={shlex.quote(ref)}; export LC_ALL=C\n"
        f'{git} rev-parse -q --verify "$ref^{{commit}}" >/dev/null '
        '|| { echo "commit $ref is not in the repository"; exit 3; }\n'
        "work=$(mktemp -d) || exit 4; trap 'rm -rf -- \"$work\"' EXIT\n"
        f'{git} init -q --template= "$work/rules" >/dev/null || exit 4\n'
        f"{git} ls-tree -r -z \"$ref\" | grep -z '^[0-7]* blob ' | sed -z 's/^[^\\t]*\\t//' "
        '| sort -zu > "$work/tracked"\n'
        "grep -zE '(^|/)\\.gitignore$' \"$work/tracked\" | while IFS= read -r -d '' g; do\n"
        '  mkdir -p -- "$work/rules/$(dirname -- "$g")" '
        f'&& {git} cat-file blob "$ref:$g" > "$work/rules/$g" || exit 4\n'
        "done || exit 4\n"
        f"{git} ls-tree -r -d -z --name-only \"$ref\" | sed -z 's|$|/|' | grep -zE {shlex.quote(pattern)} "
        '| while IFS= read -r -d \'\' d; do d=${d%/}; if [ -L "$d" ]; then rm -f -- "$d" || exit 4; fi\n'
        "done || exit 4\n"
        "find . -path ./.git -prune -o \\( -type f -o -type l \\) -printf '%P\\0' | sort -zu > \"$work/found\"\n"
        f'{git} -C "$work/rules" -c core.excludesFile=/dev/null check-ignore --no-index -z --stdin '
        '< "$work/found" > "$work/ignored"; [ $? -le 1 ] || exit 4\n'
        f'grep -zvE {shlex.quote(BYTECODE_PATTERN)} "$work/ignored" | sort -zu > "$work/kept"\n'
        '{ { cat "$work/tracked"; comm -z -23 "$work/found" "$work/kept"; } '
        f"| grep -zE {shlex.quote(pattern)}; printf %s {shlex.quote(listed)} | tr '\\n' '\\0'; }} "
        "| grep -zv '^$' | sort -zu > \"$work/restore\"\n"
        'xargs -0 -r rm -rf -- < "$work/restore" || exit 4\n'
        'comm -z -12 "$work/restore" "$work/tracked" > "$work/present"\n'
        "while IFS= read -r -d '' f; do case $f in */*) printf '%s\\0' \"${f%/*}\";; esac; done < \"$work/present\" "
        "| sort -zu | xargs -0 -r mkdir -p -- || exit 4\n"
        "while IFS= read -r -d '' f; do\n"
        f'  {git} cat-file blob "$ref:$f" > "$f" || exit 4\n'
        'done < "$work/present"\n'
        f"{git} ls-tree -r -z \"$ref\" | grep -zE '^(100755|120000) blob ' | while IFS= read -r -d '' e; do\n"
        '  f=${e#*$\'\\t\'}; grep -qzxF -- "$f" "$work/present" || continue\n'
        '  if [ "${e%% *}" = 120000 ]; then t=$(cat -- "$f") && rm -f -- "$f" && ln -s -- "$t" "$f" || exit 4\n'
        '  else chmod +x -- "$f" || exit 4; fi\n'
        "done\n"
    )


def _listing(names: list[str], limit: int = 20) -> list[str]:
    return names[:limit] + ([f"... and {len(names) - limit} more"] if len(names) > limit else [])


@dataclass(frozen=True)
class SWELogGrader(ShellGrader):
    """Grades a SWE-bench/SWE-smith instance by its test log; see the module docstring.

    `restore_ref` is the commit whose test files are authoritative. In the harness's order:
    `install` (after `test_setup`, before the test files are restored and the test patch is
    applied), then `test_setup` (environment activation, the specs' eval commands) and
    `test_command` in one clean shell in the workdir. Only the test command's output is parsed.
    `log_parser`: "swebench" (the package's parser for `repo`), a swebench `parse_log_*` name,
    or patchgym's "pytest"/"unittest". `timeout_s` bounds the install, the test-file restore
    and the test run, each.
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
    test_setup: str = ""
    install: str = ""
    log_parser: str = "swebench"
    timeout_s: float = 1800.0
    max_log_bytes: int = 4_000_000
    verdict_channel: bool = True
    canaries: bool = True

    def __post_init__(self) -> None:
        check_log_parser(self.log_parser, self.repo)

    def is_test_path(self, path: str) -> bool:
        return path in self.test_files or re.search(TEST_PATH_PATTERN, path) is not None

    async def _grade(self, sandbox: Sandbox, details: dict[str, Any]) -> tuple[float, Mapping[str, TestStatus]]:
        room = await GradingRoom.open(sandbox)
        log = shlex.quote(room.root + "/setup.log")
        if self.install:  # the harness installs before it resets the tests and applies the test patch
            steps = "; ".join(s for s in (self.test_setup, self.install) if s)
            installed = await room.run(f"{{ {steps}\n}} >> {log} 2>&1", timeout_s=self.timeout_s)
            details["install_exit_code"] = installed.exit_code
        restored = await room.run(restore_script(self.restore_ref, self.test_files), timeout_s=self.timeout_s)
        if not restored.ok:
            raise GradingSetupError("cannot restore the test files (test_restore_failed)", restored.output)
        if self.test_patch:
            patch_path = await room.write("test.patch", self.test_patch)
            applied = await room.run(f"{SAFE_GIT} apply -v {shlex.quote(patch_path)}", timeout_s=120)
            if not applied.ok:
                raise GradeFailure("test_patch_failed", applied.output[-2000:])
        setup = f"{{ {self.test_setup}\n}} >> {log} 2>&1; " if self.test_setup else ""
        if self.verdict_channel and room.python and recorder_mode(self.test_command) == "pytest":
            return await self._grade_supervised(room, f"{setup}( {self.test_command}\n) 2>&1", details)
        run = await room.run(
            f"{setup}( {self.test_command}\n) 2>&1",
            timeout_s=self.timeout_s,
            max_output_bytes=self.max_log_bytes,
            sweep=True,
        )
        details.update(exit_code=run.exit_code, test_duration_s=round(run.duration_s, 3), log_tail=run.output[-2000:])
        return self._verdict(run.output, run.exit_code, timed_out=run.timed_out, details=details)

    async def _grade_supervised(
        self, room: GradingRoom, command: str, details: dict[str, Any]
    ) -> tuple[float, Mapping[str, TestStatus]]:
        run = await supervised_run(
            room,
            command,
            mode="pytest",
            expected=(*self.fail_to_pass, *self.pass_to_pass),
            timeout_s=self.timeout_s,
            max_log_bytes=self.max_log_bytes,
            canaries=self.canaries,
        )
        details.update(exit_code=run.exit_code, test_duration_s=round(run.duration_s, 3), log_tail=run.log[-2000:])
        details.update(run.details)
        if run.failure:
            raise GradeFailure(run.failure, run.message, tests=run.tests)
        return self._verdict(as_pytest_log(run.tests), 0, timed_out=False, details=details)

    def judge_log(
        self, log: str, exit_code: int | None, *, timed_out: bool = False, details: dict[str, Any] | None = None
    ) -> Grade:
        """The verdict on one test run's log and exit code (also usable on stored logs)."""
        details = {} if details is None else details
        try:
            reward, tests = self._verdict(log, exit_code, timed_out=timed_out, details=details)
        except GradeFailure as failure:
            return zero_grade(failure.reason, details, message=failure.message, tests=failure.tests)
        return Grade(reward=reward, resolved=reward >= 1.0, tests=dict(tests), details=details)

    def _verdict(
        self, log: str, exit_code: int | None, *, timed_out: bool, details: dict[str, Any]
    ) -> tuple[float, Mapping[str, TestStatus]]:
        if timed_out:
            raise GradeFailure("tests_timed_out")
        status_map = parse_log(log, self.log_parser, repo=self.repo, instance_id=self.instance_id, version=self.version)
        tests = {name: _status(value) for name, value in status_map.items()}
        if not tests:
            raise GradeFailure("no_test_results")
        if exit_code != 0 and not any(s in (TestStatus.FAILED, TestStatus.ERROR) for s in tests.values()):
            raise GradeFailure("exit_code_mismatch", tests=tests)
        resolution, report = judge(status_map, list(self.fail_to_pass), list(self.pass_to_pass), repo=self.repo)
        resolved = resolution == "RESOLVED_FULL"
        details.update(resolution=resolution, reason="resolved" if resolved else "tests_failed")
        details["report_counts"] = {  # the lists below are cut to their first names; these are whole
            group: {k: len(v) for k, v in outcome.items() if isinstance(v, list | tuple)}
            for group, outcome in report.items()
            if isinstance(outcome, dict)
        }
        details["report"] = {
            group: {k: _listing(list(v)) if isinstance(v, list | tuple) else v for k, v in outcome.items()}
            if isinstance(outcome, dict)
            else outcome
            for group, outcome in report.items()
        }
        return (1.0 if resolved else 0.0), tests
