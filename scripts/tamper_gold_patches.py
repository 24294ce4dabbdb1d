"""False positives of the static tamper checks on real fixes: every gold patch we can read.

Sources, each graded as a SWE-bench gold patch is (its non-test part, test paths by
`swe_grading.TEST_PATH_PATTERN`, against the pristine tree's paths):
- the SWE-bench Lite rows shipped in tests/fixtures/swebench (their `patch` applied to the
  fixture repositories' `base_commit`);
- first-parent commits of local git repositories (`--repo PATH`, e.g. the mirrors of
  pytest-dev/pytest, psf/requests, pylint-dev/pylint): a merged pull request's non-test diff is
  what a SWE-bench gold patch is cut from.

    python scripts/tamper_gold_patches.py --repo /work/.mirror/pytest-dev+pytest/repo --commits 2000

Prints each flagged patch with its findings and the false-positive count (patches flagged).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from patchgym.core.tamper import tamper_findings
from patchgym.core.tree_diff import FileChange
from patchgym.plugins.swe_grading import TEST_PATH_PATTERN

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEST_PATH = re.compile(TEST_PATH_PATTERN)
ZEROS = "0" * 40


def git(repo: Path, *args: str, data: bool = False, env: dict[str, str] | None = None) -> bytes:
    return subprocess.run(
        ["git", f"--git-dir={repo}", *args], check=True, capture_output=True, env={**os.environ, **(env or {})}
    ).stdout


def _changes(repo: Path, old_tree: str, new_tree: str, env: dict[str, str] | None = None) -> list[FileChange]:
    """Changed non-test files between two tree-ish (":" for the index of `env`)."""
    raw = git(
        repo,
        "diff-tree" if new_tree != ":" else "diff-index",
        "-r",
        "--no-renames",
        "-z",
        "--raw",
        *([old_tree, new_tree] if new_tree != ":" else ["--cached", old_tree]),
        env=env,
    )
    fields = raw.split(b"\0")
    changes = []
    for meta, path in zip(fields[0::2], fields[1::2], strict=False):
        if not meta.startswith(b":"):
            continue
        old_mode, new_mode, old_sha, new_sha, _ = meta[1:].decode().split(" ")
        name = path.decode("utf-8", "replace")
        if TEST_PATH.search(name) or "160000" in (old_mode, new_mode) or not _read(name):
            continue

        def blob(sha: str) -> bytes | None:
            return None if sha == ZEROS else git(repo, "cat-file", "blob", sha)

        link = new_mode == "120000"
        new = blob(new_sha) if new_sha != ZEROS or new_tree != ":" else None
        if new_tree == ":" and new_sha == ZEROS and new_mode != "000000":
            new = git(repo, "show", f":{name}", env=env)
        changes.append(
            FileChange(
                name,
                None if old_mode == "120000" else blob(old_sha),
                None if link else new,
                new.decode() if link and new else None,
                new_mode == "100755",
            )
        )
    return changes


def _read(name: str) -> bool:
    """Whether the checks read this file's content (others only count by their path)."""
    return (
        name.endswith((".py", ".pyw", ".pth", ".toml", ".cfg", ".ini", ".txt", ".sh", ".env", ".so"))
        or "." not in name.rsplit("/", 1)[-1]
    )


def _paths(repo: Path, tree: str) -> set[str]:
    return set(git(repo, "ls-tree", "-r", "-z", "--name-only", tree).decode("utf-8", "replace").split("\0")) - {""}


def history(repo: Path, commits: int) -> Iterator[tuple[str, list[FileChange], set[str]]]:
    """One gold-patch-shaped change per first-parent commit that touches code or configuration."""
    shas = git(repo, "log", "--first-parent", "--format=%H %P", f"-n{commits}").decode().splitlines()
    for line in shas:
        sha, *parents = line.split()
        if not parents:
            continue
        changes = _changes(repo, parents[0], sha)
        if any(c.path.endswith((".py", ".toml", ".cfg", ".ini", ".pth")) for c in changes):
            yield f"{repo.parent.name}@{sha[:10]}", changes, _paths(repo, parents[0])


def fixture_rows() -> list[tuple[str, list[FileChange], set[str]]]:
    from tests.swebench_lite import extract_sources, lite_rows

    patches = []
    with tempfile.TemporaryDirectory() as scratch:
        repos = extract_sources(Path(scratch) / "repos")
        for instance, row in lite_rows().items():
            repo = repos / f"{row['repo'].replace('/', '__')}.git"
            env = {"GIT_INDEX_FILE": str(Path(scratch) / f"{instance}.index")}
            git(repo, "read-tree", row["base_commit"], env=env)
            subprocess.run(
                ["git", f"--git-dir={repo}", "apply", "--cached", "-"],
                input=row["patch"].encode(),
                check=True,
                env={**os.environ, **env},
            )
            patches.append((instance, _changes(repo, row["base_commit"], ":", env), _paths(repo, row["base_commit"])))
    return patches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, action="append", default=[], help="a git directory (repeatable)")
    parser.add_argument("--commits", type=int, default=1000, help="first-parent commits per repository")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    patches = itertools.chain(fixture_rows(), *(history(repo, args.commits) for repo in args.repo))
    flagged = total = 0
    seconds: list[float] = []
    for name, changes, pristine in patches:
        total += 1
        started = time.perf_counter()
        findings = tamper_findings(changes, pristine=pristine)
        seconds.append(time.perf_counter() - started)
        if findings:
            flagged += 1
            print(name, json.dumps([f.as_dict() for f in findings[:5]]))
    seconds.sort()
    median, worst = (seconds[len(seconds) // 2], seconds[-1]) if seconds else (0.0, 0.0)
    counts = {"patches": total, "flagged": flagged, "check_median_s": round(median, 4), "check_max_s": round(worst, 4)}
    print(
        json.dumps(counts)
        if args.json
        else f"{flagged} of {total} gold patches flagged (false positives); "
        f"check time per patch: median {median * 1000:.1f} ms, max {worst * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
