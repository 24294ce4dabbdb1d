"""The `swesmith` task set: SWE-smith-format instances, where `patch` is the bug.

Rows carry `instance_id, repo, patch, FAIL_TO_PASS, PASS_TO_PASS, problem_statement,
base_commit` and usually `image_name`. `repo` is `swesmith/{owner}__{name}.{commit8}` (or
`owner/name` with a `commit` field); the image defaults to SWE-smith's repo snapshot
convention `{namespace}/swesmith.{arch}.{owner}_1776_{name}.{commit8}`, holding the clean
repository at `/testbed` at `base_commit`. With `repos_dir`, the snapshot is the local checkout
`{repos_dir}/{owner}__{name}.{commit8}` instead.

Setup applies the bug and commits it, then removes and commits away the files of the
FAIL_TO_PASS tests (as SWE-smith's instance branches do), so `git diff` shows only the agent's
work. Grading restores every test file from `base_commit` (agent edits to tests are reverted,
the hidden tests come back) and runs the tests (`test_cmd`, by default pytest's `-rA`
summary parsed with swebench's `parse_log_pytest`). The oracle reverts the bug patch.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import Register, hookimpl
from patchgym.core.sandbox import SandboxSpec
from patchgym.core.tasks import Task, sandbox_limits
from patchgym.core.validation import PATCH_DELIMITER
from patchgym.plugins.swe_data import LIST_FIELDS, listed_tests, require, swesmith_image
from patchgym.plugins.swe_grading import SAFE_GIT, SWELogGrader
from patchgym.plugins.swebench import SWEBenchTaskSet

DEFAULT_TEST_COMMAND = "pytest --disable-warnings --color=no --tb=no -rA -p no:cacheprovider"
DEFAULT_LOG_PARSER = "parse_log_pytest"
REQUIRED_FIELDS = ("instance_id", "repo", "patch", "problem_statement", "base_commit")
COMMIT = f"{SAFE_GIT} -c user.name=patchgym -c user.email=patchgym@localhost commit -q --no-verify --allow-empty"
_SNAPSHOT = re.compile(r"^(?:[^/]+/)?(?P<owner>[^/]+?)__(?P<name>[^/]+)\.(?P<commit>[0-9a-fA-F]{6,40})$")


def snapshot(row: Mapping[str, Any]) -> tuple[str, str, str]:
    """(owner/name, commit, snapshot folder name) of a row's repository."""
    match = _SNAPSHOT.match(row["repo"])
    if match:
        repo = f"{match['owner']}/{match['name']}"
        return repo, match["commit"], f"{match['owner']}__{match['name']}.{match['commit']}"
    if row.get("commit") and "/" in row["repo"]:
        owner, name = row["repo"].split("/", 1)
        return row["repo"], row["commit"], f"{owner}__{name}.{row['commit'][:8]}"
    raise ConfigError(
        f"instance {row['instance_id']!r}: repo {row['repo']!r} is neither 'swesmith/owner__name.commit8' "
        "nor 'owner/name' with a commit field"
    )


def heredoc(command: str, body: str) -> str:
    """`command` reading `body` on stdin."""
    if PATCH_DELIMITER in body:
        raise ConfigError(f"a patch may not contain the line {PATCH_DELIMITER}")
    text = body if body.endswith("\n") else body + "\n"
    return f"{command} <<'{PATCH_DELIMITER}'\n{text}{PATCH_DELIMITER}"


class SWESmithTaskSet(SWEBenchTaskSet):
    """SWE-smith instances; options as `SWEBenchTaskSet`, plus the default `test_command` and
    `log_parser` for rows that name none.

    Args:
        path: a JSON/JSONL/Parquet file of SWE-smith instances, or a Hugging Face dataset name (e.g. SWE-bench/SWE-
            smith)
        test_command: the test command of rows that name none (test_cmd)
        log_parser: the swebench log parser of rows that name none; also takes every option of swebench (split, limit,
            subset, ...)
    """

    name = "swesmith"

    def __init__(
        self,
        path: str,
        *,
        test_command: str = DEFAULT_TEST_COMMAND,
        log_parser: str = DEFAULT_LOG_PARSER,
        **options: Any,
    ) -> None:
        super().__init__(path, **options)
        self.options.update(test_command=test_command, log_parser=log_parser)

    def sandbox_spec(self, row: Mapping[str, Any]) -> SandboxSpec:
        repo, commit, folder = snapshot(row)
        workspace = None
        if self.options["repos_dir"] is not None:
            workspace = self.options["repos_dir"] / folder
            if not workspace.is_dir():
                raise ConfigError(f"repos_dir has no snapshot of {repo} (expected {workspace})")
        image = row.get("image_name") or swesmith_image(
            repo, commit, namespace=self.options["namespace"], arch=self.options["arch"]
        )
        return SandboxSpec(
            workspace=workspace,
            image=image,
            workdir="/testbed",
            **sandbox_limits(),
            labels={"task_id": row["instance_id"]},
        )

    def task(self, row: Mapping[str, Any]) -> Task:
        require(row, REQUIRED_FIELDS, self.path)
        instance_id = row["instance_id"]
        f2p, p2p = (listed_tests(row.get(field), field, instance_id) for field in LIST_FIELDS)
        if not f2p:
            raise ConfigError(f"instance {instance_id!r} has an empty FAIL_TO_PASS: nothing could show a fix")
        hidden = sorted({name.split("::")[0] for name in f2p if "::" in name})
        activate = [self.options["activate"]] if self.options["activate"] else []
        command = row.get("test_cmd") or self.options["test_command"]
        grader = SWELogGrader(
            instance_id=instance_id,
            repo=snapshot(row)[0],
            version=str(row.get("version", "")),
            fail_to_pass=tuple(f2p),
            pass_to_pass=tuple(p2p),
            test_setup="; ".join(activate),
            test_command=command,
            restore_ref=row["base_commit"],
            test_files=tuple(hidden),
            log_parser=row.get("log_parser") or self.options["log_parser"],
            timeout_s=self.options["test_timeout_s"],
        )
        base = shlex.quote(row["base_commit"])
        hide = " ".join(shlex.quote(path) for path in hidden)
        setup = (
            f"{SAFE_GIT} checkout -q {base} && " + heredoc(f"{SAFE_GIT} apply -v", row["patch"]),
            f"{SAFE_GIT} add -A && {COMMIT} -m 'bug'",
            (f"{SAFE_GIT} rm -q --ignore-unmatch -- {hide} && " if hide else "") + f"{COMMIT} -m 'hide failing tests'",
        )
        return Task(
            id=instance_id,
            instruction=row["problem_statement"],
            sandbox=self.sandbox_spec(row),
            grader=grader,
            setup_commands=setup,
            oracle=heredoc(f"{SAFE_GIT} apply -v -R", row["patch"]),
            metadata={"repo": row["repo"], "base_commit": row["base_commit"], "hidden_tests": hidden},
        )


@hookimpl
def register_task_sets(register: Register) -> None:
    register("swesmith", SWESmithTaskSet, "SWE-smith-format instances, patch = the bug (options: path, limit)")
