"""The shell that starts a run cannot reach its sandboxes or their grading: its `PYTHONPATH`, `PATH`,
`GIT_*` settings, `HOME` and locale stay outside, so verdicts do not depend on who runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.sandbox import SandboxSpec
from tests.conftest import require_docker

ROOT = Path(__file__).resolve().parent.parent


def hostile_environment(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A caller's environment whose every part would change a verdict if it reached the sandbox: a
    `sitecustomize` that fails the interpreter inside, `git` and `python3` that fail, a git config
    that rewrites files, another HOME and locale. Returns it and the file its programs write to."""
    marks = tmp_path / "reached"
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir()
    bin_dir.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import os, sys\nif os.getpid() != {os.getpid()} and 'patchgym' not in sys.argv[0]:\n"
        f"    open({str(marks)!r}, 'a').write('sitecustomize ' + repr(sys.argv) + '\\n')\n"
        "    raise SystemExit(3)\n"
    )
    for tool in ("git", "python3", "python", "pytest"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> {marks}\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    config = tmp_path / "gitconfig"
    config.write_text('[core]\n\tautocrlf = true\n[filter "x"]\n\tsmudge = false\n')
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "GIT_CONFIG_GLOBAL": str(config),
        "GIT_DIR": str(tmp_path / "not-a-repo"),
        "HOME": str(tmp_path / "home"),
        "LANG": "tr_TR.UTF-8",
        "LC_ALL": "tr_TR.UTF-8",
        "PYTHONSAFEPATH": "1",
    }
    return env, marks


@pytest.mark.parametrize("isolation", ["none", "bwrap"])
async def test_a_sandbox_does_not_inherit_the_callers_environment(
    isolation: str, tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if isolation == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    env, _ = hostile_environment(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "boxes").mkdir()
    backend = LocalSandboxBackend(isolation=isolation, root_dir=tmp_path / "boxes")
    try:
        async with await backend.create(SandboxSpec(workspace=workspace)) as box:
            result = await box.exec("env", timeout_s=60)
    finally:
        await backend.aclose()
    inside = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    leaked = {k for k in ("PYTHONPATH", "GIT_CONFIG_GLOBAL", "GIT_DIR", "LC_ALL", "PYTHONSAFEPATH") if k in inside}
    assert not leaked, leaked
    assert str(tmp_path / "bin") not in inside["PATH"].split(os.pathsep)
    assert inside["HOME"] != env["HOME"]
    assert inside["LANG"] == "C.UTF-8"


@pytest.mark.parametrize("sandbox", ["local", "docker"])
def test_grading_verdicts_do_not_depend_on_the_callers_environment(sandbox: str, tmp_path: Path) -> None:
    """`patchgym tasks validate` (gold 1, no change 0 on every task) from a hostile shell: the same
    verdicts, and none of the caller's programs ran for the sandbox."""
    if sandbox == "docker":
        require_docker()
    env, marks = hostile_environment(tmp_path)
    command = [
        str(Path(sys.executable).parent / "patchgym"),
        "tasks",
        "validate",
        "tiny",
        "--sandbox",
        sandbox,
        "--limit",
        "3",
    ]
    done = subprocess.run([*command, "--json"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tasks = json.loads(done.stdout)["tasks"]
    assert [(t["gold_reward"], t["empty_reward"]) for t in tasks] == [(1.0, 0.0)] * 3, tasks
    assert not marks.exists(), marks.read_text()
