"""Red team: attacks on the sandbox itself (issue 27, kinds 5, 6 and 8), on bwrap and Docker.

Kind 5, leak: a sandbox of a `tiny` task looks for the task's gold patch (find over the whole
file system, patchgym's import path, site-packages), for an editable install and for a real
wheel installed into a fresh venv. On main the wheel's copy was readable from bwrap sandboxes
(the venv is bound read-only); the installed package and the task folder are masked now
(`patchgym.backends.sandbox.hidden`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchgym.backends.sandbox.hidden import hidden_host_paths, mask_args
from tests.conftest import require_docker

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("leak_probe.py")


def require_bwrap() -> None:
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")


def probe(python: str, kind: str, tmp_path: Path, cwd: Path) -> dict:
    done = subprocess.run(
        [python, str(PROBE), kind, str(tmp_path)], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of a fresh venv holding a wheel built from this checkout (its dependencies come
    from this venv through a .pth line, so nothing is downloaded)."""
    folder = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT), "-w"]
    subprocess.run([*build, str(folder / "dist")], check=True, capture_output=True, cwd=folder, timeout=600)
    (wheel,) = (folder / "dist").glob("patchgym-*.whl")
    venv = folder / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)  # type: ignore[attr-defined]
    python = str(venv / "bin" / "python")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    site_dir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    ours = next(p for p in sys.path if p.endswith("site-packages"))
    Path(site_dir, "zz_patchgym_test_deps.pth").write_text(ours + "\n")
    return python


def test_a_wheel_installs_gold_patches_that_no_bwrap_sandbox_can_read(wheel_python: str, tmp_path: Path) -> None:
    require_bwrap()
    found = probe(wheel_python, "bwrap", tmp_path, cwd=tmp_path)
    assert "site-packages" in found["package"] and "/tmp" in found["package"] or str(tmp_path) not in found["package"]
    assert Path(found["package"]).parent.joinpath("plugins/tiny/tasks/roman-subtractive/gold.patch").is_file()
    assert not any(r["found"] for r in found["results"].values()), found


def test_an_editable_install_leaves_no_gold_patch_readable_from_bwrap(tmp_path: Path) -> None:
    require_bwrap()
    found = probe(sys.executable, "bwrap", tmp_path, cwd=ROOT)
    assert found["package"] == str(ROOT / "patchgym" / "__init__.py")
    assert not any(r["found"] for r in found["results"].values()), found


def test_no_gold_patch_is_readable_from_docker(wheel_python: str, tmp_path: Path) -> None:
    require_docker()
    for python, cwd in ((sys.executable, ROOT), (wheel_python, tmp_path)):
        found = probe(python, "docker", tmp_path, cwd=cwd)
        assert not any(r["found"] for r in found["results"].values()), found


def test_masks_cover_the_package_and_task_folders_but_never_the_interpreter(tmp_path: Path) -> None:
    """A checkout holding its own venv (as a development checkout does): the checkout is hidden
    entry by entry, the venv stays; folders outside what is bound need no mask."""
    checkout = tmp_path / "opt" / "patchgym-src"
    for folder in ("patchgym/plugins/tiny", "tests/fixtures", ".venv/bin"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "patchgym"\n')
    task = tmp_path / "opt" / "tasks" / "t1"
    (task / "repo").mkdir(parents=True)
    hidden = [str(checkout), str(task), str(tmp_path / "elsewhere")]
    args = mask_args(hidden, bound=[str(tmp_path / "opt")], keep=[str(checkout / ".venv")])
    masked = args[1::4]
    assert masked == sorted([str(checkout / "patchgym"), str(checkout / "tests"), str(task)])
    assert args[:4] == ["--tmpfs", masked[0], "--remount-ro", masked[0]]
    paths = hidden_host_paths(task / "repo", extra=["/srv/tasks"])
    assert str(task) in paths and "/srv/tasks" in paths
    assert os.path.realpath(str(ROOT / "patchgym")) in paths  # this (editable) install
