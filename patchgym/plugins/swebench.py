"""The `swebench` task set: SWE-bench-format instances (SWE-bench, Verified, SWE-Gym, ...).

Rows carry `instance_id, repo, base_commit, patch, test_patch, problem_statement,
FAIL_TO_PASS, PASS_TO_PASS, version` (F2P/P2P as lists or JSON strings). Each task runs in the
swebench harness's instance image (`{namespace}/sweb.eval.{arch}.{id}:{tag}`, or the row's
`image_name`) with the repository at `/testbed`; or, with `repos_dir`, from a local checkout
`{repos_dir}/{instance_id}` (for the local sandbox). The test command comes from the
`swebench` package's `MAP_REPO_VERSION_TO_SPECS` and test directives (a row may override it
with `test_cmd`), and grading is `SWELogGrader` (hardened; swebench's parsers and rules).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import Register, hookimpl
from patchgym.core.sandbox import SandboxSpec
from patchgym.core.tasks import LoadedTaskSet, Task, sandbox_limits
from patchgym.plugins.swe_data import (
    LIST_FIELDS,
    listed_tests,
    load_rows,
    patch_files,
    require,
    stratified_subset,
    swebench_image,
)
from patchgym.plugins.swe_grading import SWELogGrader, swebench_available

CONDA_ACTIVATE = "source /opt/miniconda3/bin/activate && conda activate testbed"
"""How the swebench harness's images enter the test environment."""

REQUIRED_FIELDS = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")


def swebench_test_command(row: Mapping[str, Any]) -> tuple[list[str], str]:
    """(environment commands, test command) for a row, from the `swebench` package's specs."""
    if not swebench_available():
        raise ConfigError(
            f"instance {row['instance_id']!r} has no test_cmd and the swebench package is not installed: "
            "pip install 'patchgym[swebench]'"
        )
    from swebench.harness.constants import MAP_REPO_VERSION_TO_SPECS
    from swebench.harness.test_spec.python import get_test_directives

    specs = MAP_REPO_VERSION_TO_SPECS.get(row["repo"], {}).get(str(row.get("version")))
    if specs is None:
        raise ConfigError(
            f"instance {row['instance_id']!r}: swebench has no specs for {row['repo']} version "
            f"{row.get('version')!r}; give the row a test_cmd (and log_parser)"
        )
    test_cmd = specs["test_cmd"]
    steps = list(specs.get("eval_commands", []))
    if isinstance(test_cmd, list):
        steps += test_cmd[:-1]
        test_cmd = test_cmd[-1]
    directives = get_test_directives({"repo": row["repo"], "test_patch": row["test_patch"]})
    return steps, " ".join([test_cmd, *directives])


class SWEBenchTaskSet(LoadedTaskSet):
    """SWE-bench instances from a local file or a hub dataset; see the module docstring.

    Options: `path` (file or hub name), `split`, `limit` (first N), `subset` (a stratified-by-repo
    sample of N, seeded by `seed`), `ids` (comma-separated instance ids), image `namespace`,
    `tag`, `arch`, `repos_dir`, `activate` (environment activation, "" for none), `reinstall`
    (off by default: run the specs' install step again before the test patch is applied, as the
    harness does; the harness's images are installed already, and the install needs the network
    a sandbox has not), `test_timeout_s`.

    Args:
        path: a JSON/JSONL/Parquet file of instances, or a Hugging Face dataset name (e.g. princeton-nlp/SWE-
            bench_Verified)
        split: the dataset split of a Hub dataset
        limit: only the first N instances (null: all)
        subset: a sample of N instances stratified by repository, drawn with seed (null: all)
        seed: seed of the subset sample
        ids: only these instance ids, comma-separated (null: all)
        namespace: registry namespace of the harness's instance images ({namespace}/sweb.eval.{arch}.{id}:{tag})
        tag: tag of the instance images
        arch: architecture in the instance image names: x86_64 or arm64
        repos_dir: run each task from a local checkout {repos_dir}/{instance_id} instead of an image (for the local
            sandbox)
        activate: shell command that enters the test environment before tests run ("" for none)
        reinstall: run the specs' install step again before the test patch is applied, as the harness does (needs
            network)
        test_timeout_s: seconds the test command of one grading may run
    """

    name = "swebench"

    def __init__(
        self,
        path: str,
        *,
        split: str = "test",
        limit: int | None = None,
        subset: int | None = None,
        seed: int = 0,
        ids: str | None = None,
        namespace: str = "swebench",
        tag: str = "latest",
        arch: str = "x86_64",
        repos_dir: str | None = None,
        activate: str = CONDA_ACTIVATE,
        reinstall: bool = False,
        test_timeout_s: float = 1800.0,
    ) -> None:
        self.path = str(path)
        self.options = {
            "split": split,
            "limit": _int(limit),
            "subset": _int(subset),
            "seed": _int(seed),
            "ids": ids,
            "namespace": namespace,
            "tag": tag,
            "arch": arch,
            "repos_dir": Path(repos_dir) if repos_dir else None,
            "activate": activate,
            "reinstall": _bool(reinstall),
            "test_timeout_s": float(test_timeout_s),
        }

    def settings(self) -> dict[str, Any]:
        return {"path": self.path, **{k: str(v) if isinstance(v, Path) else v for k, v in self.options.items()}}

    def select(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply `ids`, `subset` and `limit`, in that order."""
        if self.options["ids"]:
            wanted = [i.strip() for i in self.options["ids"].split(",") if i.strip()]
            known = {row.get("instance_id") for row in rows}
            unknown = [i for i in wanted if i not in known]
            if unknown:
                raise ConfigError(f"{self.path} has no instance(s) {', '.join(unknown)}")
            rows = [row for row in rows if row.get("instance_id") in wanted]
        if self.options["subset"]:
            rows = list(stratified_subset(rows, self.options["subset"], seed=self.options["seed"]))  # type: ignore[arg-type]
        return rows[: self.options["limit"]] if self.options["limit"] else rows

    def load(self) -> list[Task]:
        rows = self.select(load_rows(self.path, split=self.options["split"]))
        if not rows:
            raise ConfigError(f"{self.path} holds no instances")
        return [self.task(row) for row in rows]

    def _environment(self, row: Mapping[str, Any]) -> tuple[list[str], str, str]:
        """(set-up steps, install step, test command) for a row."""
        if row.get("test_cmd"):
            return [], "", str(row["test_cmd"])
        steps, command = swebench_test_command(row)
        install = ""
        if self.options["reinstall"]:
            from swebench.harness.constants import MAP_REPO_VERSION_TO_SPECS

            install = MAP_REPO_VERSION_TO_SPECS[row["repo"]][str(row["version"])].get("install") or ""
        return steps, install, command

    def sandbox_spec(self, row: Mapping[str, Any]) -> SandboxSpec:
        instance_id = row["instance_id"]
        workspace = None
        if self.options["repos_dir"] is not None:
            workspace = self.options["repos_dir"] / instance_id
            if not workspace.is_dir():
                raise ConfigError(f"repos_dir has no checkout for {instance_id!r} (expected {workspace})")
        image = row.get("image_name") or swebench_image(
            instance_id, namespace=self.options["namespace"], arch=self.options["arch"], tag=self.options["tag"]
        )
        return SandboxSpec(
            workspace=workspace, image=image, workdir="/testbed", **sandbox_limits(), labels={"task_id": instance_id}
        )

    def task(self, row: Mapping[str, Any]) -> Task:
        """The task for one instance row."""
        require(row, REQUIRED_FIELDS, self.path)
        instance_id = row["instance_id"]
        f2p, p2p = (listed_tests(row.get(field), field, instance_id) for field in LIST_FIELDS)
        if not f2p:
            raise ConfigError(f"instance {instance_id!r} has an empty FAIL_TO_PASS: nothing could show a fix")
        steps, install, command = self._environment(row)
        activate = [self.options["activate"]] if self.options["activate"] else []
        grader = SWELogGrader(
            instance_id=instance_id,
            repo=row["repo"],
            version=str(row.get("version", "")),
            fail_to_pass=tuple(f2p),
            pass_to_pass=tuple(p2p),
            test_setup="; ".join([*activate, *steps]),
            test_command=command,
            install=install,
            restore_ref=row["base_commit"],
            test_files=tuple(patch_files(row["test_patch"])),
            test_patch=row["test_patch"],
            log_parser=row.get("log_parser") or ("swebench" if not row.get("test_cmd") else "pytest"),
            timeout_s=self.options["test_timeout_s"],
        )
        return Task(
            id=instance_id,
            instruction=row["problem_statement"],
            sandbox=self.sandbox_spec(row),
            grader=grader,
            gold_patch=row["patch"],
            metadata={"repo": row["repo"], "version": row.get("version"), "base_commit": row["base_commit"]},
        )


def _int(value: Any) -> int | None:
    return None if value is None or value == "" else int(value)


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@hookimpl
def register_task_sets(register: Register) -> None:
    register("swebench", SWEBenchTaskSet, "SWE-bench-format instances (options: path=FILE|HUB_NAME, subset, limit)")
