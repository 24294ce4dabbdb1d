"""Hand-made SWE-bench, SWE-smith and Harbor fixtures: a tiny `calc` package with pytest tests.

The repositories are real git repositories made here; the images are built FROM the offline
base image with this interpreter's pytest copied in (see test_grading.pytest_image_context).
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.test_grading import pytest_image_context

GIT_ENV = {
    "GIT_AUTHOR_NAME": "fixture",
    "GIT_AUTHOR_EMAIL": "fixture@localhost",
    "GIT_COMMITTER_NAME": "fixture",
    "GIT_COMMITTER_EMAIL": "fixture@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}
CALC_BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_FIXED = CALC_BUGGY.replace("a - b", "a + b")
TEST_MUL = "from calc import mul\n\n\ndef test_mul():\n    assert mul(3, 4) == 12\n"
TEST_ADD = "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n"
TEST_CALC = TEST_MUL.replace("import mul", "import add, mul") + "\n\ndef test_add():\n    assert add(2, 2) == 4\n"


def make_diff(path: str, old: str | None, new: str) -> str:
    """A git-style unified diff of one file (`old` None: a new file)."""
    lines = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        new.splitlines(keepends=True),
        "/dev/null" if old is None else f"a/{path}",
        f"b/{path}",
    )
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    return header + "".join(lines)


FIX_PATCH = make_diff("calc/__init__.py", CALC_BUGGY, CALC_FIXED)
BUG_PATCH = make_diff("calc/__init__.py", CALC_FIXED, CALC_BUGGY)
TEST_PATCH = make_diff("tests/test_calc.py", TEST_MUL, TEST_CALC)
SWEBENCH_F2P = ["tests/test_calc.py::test_add"]
SWEBENCH_P2P = ["tests/test_calc.py::test_mul"]
F2P = ["tests/test_add.py::test_add"]
P2P = ["tests/test_mul.py::test_mul"]
PYTEST_SHIM = (
    "RUN printf '#!/bin/sh\\nexec python3 -m pytest \"$@\"\\n' > /usr/local/bin/pytest "
    "&& chmod +x /usr/local/bin/pytest\n"
)


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def make_repo(root: Path, files: dict[str, str], links: dict[str, str] | None = None) -> str:
    """A git repository at `root` holding `files` (a `#!` first line makes one executable) and
    symbolic `links` (path -> target), committed; returns the commit."""
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
        if content.startswith("#!"):
            (root / name).chmod(0o755)
    for name, target in (links or {}).items():
        (root / name).symlink_to(target)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "snapshot")
    return git(root, "rev-parse", "HEAD")


def swebench_fixture(
    tmp_path: Path, extra_files: dict[str, str] | None = None, links: dict[str, str] | None = None
) -> tuple[Path, dict[str, Any]]:
    """(repos_dir, instance row): the buggy checkout at base_commit (with `extra_files` and
    symbolic `links` committed too) and its SWE-bench row.

    The row names a real SWE-bench repository/version whose specs run plain `pytest -rA`
    (marshmallow 3.0), so the swebench package supplies the test command and log parser.
    """
    instance_id = "fixture__calc-1"
    repos = tmp_path / "repos"
    files = {"calc/__init__.py": CALC_BUGGY, "tests/__init__.py": "", "tests/test_calc.py": TEST_MUL}
    base = make_repo(repos / instance_id, {**files, **(extra_files or {})}, links)
    row = {
        "instance_id": instance_id,
        "repo": "marshmallow-code/marshmallow",
        "version": "3.0",
        "base_commit": base,
        "patch": FIX_PATCH,
        "test_patch": TEST_PATCH,
        "problem_statement": "add() subtracts instead of adding\n",
        "FAIL_TO_PASS": json.dumps(SWEBENCH_F2P),
        "PASS_TO_PASS": json.dumps(SWEBENCH_P2P),
    }
    return repos, row


def swesmith_fixture(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """(repos_dir, instance row): the clean snapshot and a SWE-smith row whose patch is the bug."""
    repos = tmp_path / "smith-repos"
    folder = repos / "staging"
    base = make_repo(
        folder,
        {
            "calc/__init__.py": CALC_FIXED,
            "tests/__init__.py": "",
            "tests/test_mul.py": TEST_MUL,
            "tests/test_add.py": TEST_ADD,
        },
    )
    snapshot = f"fixture__calc.{base[:8]}"
    folder.rename(repos / snapshot)
    row = {
        "instance_id": f"{snapshot}.func_pm_op_change__abc123",
        "repo": f"swesmith/{snapshot}",
        "base_commit": base,
        "patch": BUG_PATCH,
        "problem_statement": "Adding two numbers gives the wrong answer\n",
        "FAIL_TO_PASS": F2P,
        "PASS_TO_PASS": P2P,
    }
    return repos, row


def build_image(tmp_path: Path, repo: Path, tag: str) -> str:
    """Build `tag` FROM the base image with pytest and `repo` (with its .git) at /testbed."""
    import docker

    context = tmp_path / f"context-{abs(hash(tag))}"
    pytest_image_context(context)
    env = context / "environment"
    subprocess.run(["cp", "-a", str(repo), str(env / "testbed")], check=True)
    dockerfile = (env / "Dockerfile").read_text() + PYTEST_SHIM + "COPY testbed/ /testbed/\nWORKDIR /testbed\n"
    (env / "Dockerfile").write_text(dockerfile)
    client = docker.from_env()
    try:
        client.images.build(path=str(env), tag=tag, network_mode="none", rm=True, forcerm=True)
    finally:
        client.close()
    return tag


HARBOR_TEST_SH = """#!/bin/bash
cd /app
if python3 -c 'import calc, sys; sys.exit(0 if calc.add(2, 2) == 4 and calc.mul(3, 4) == 12 else 1)'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def harbor_fixture(root: Path, *, test_sh: str = HARBOR_TEST_SH, name: str = "calc-add") -> Path:
    """A Harbor task folder: fix calc.add in /app; test.sh writes the reward file."""
    folder = root / name
    files = {
        "instruction.md": "In /app, calc.add(2, 2) returns 0. Make it add.\n",
        "task.toml": (
            'version = "1.0"\n[agent]\ntimeout_sec = 300\n[verifier]\ntimeout_sec = 60\n'
            "[environment]\ncpus = 1\nmemory_mb = 512\n"
        ),
        "environment/Dockerfile": "FROM patchgym/base:latest\nWORKDIR /app\nCOPY calc/ /app/calc/\n",
        "environment/calc/__init__.py": CALC_BUGGY,
        "tests/test.sh": test_sh,
        "solution/solve.sh": "#!/bin/bash\nsed -i 's/a - b/a + b/' /app/calc/__init__.py\n",
    }
    for relative, content in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(content)
    return folder
