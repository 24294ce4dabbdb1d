"""Host paths a bwrap sandbox must never read, though they lie under a directory it binds.

A bwrap sandbox sees the system directories and this interpreter's installation read-only
(`local.BWRAP_HOST_DIRS`, `local._interpreter_dirs`). patchgym itself may be installed there: a
wheel in the venv's site-packages, or in /usr/local, ships the `tiny` tasks' gold patches and
every other piece of task data in the package. Each path returned here is covered by an empty
read-only tmpfs in every sandbox:

- every installed copy of the `patchgym` package this interpreter can find (its import path
  and `patchgym` in each site directory), by real path;
- for an editable install (the package is not in a site directory), the source checkout that
  holds it (the folder with patchgym's `pyproject.toml`): its tests and fixtures too;
- the folder holding a task's workspace (a task folder: `<task>/repo` beside `gold.patch`);
- the backend's own `hidden_paths` setting (e.g. the root of a task set kept under /opt).
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "patchgym"


def _site_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [os.path.realpath(d) for d in dirs if d]


def package_dirs() -> list[str]:
    """Real paths of every copy of the patchgym package this interpreter can import or find."""
    found: set[str] = set()
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        found.add(os.path.realpath(location))
    for folder in [*_site_dirs(), *sys.path]:
        candidate = os.path.join(folder or ".", PACKAGE)
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            found.add(os.path.realpath(candidate))
    return sorted(found)


def checkout_of(package_dir: str) -> str | None:
    """The source checkout of an editable install (a folder whose pyproject.toml names patchgym), else None."""
    parent = Path(package_dir).parent
    if any(str(parent) == d for d in _site_dirs()) or parent.name in ("site-packages", "dist-packages"):
        return None
    pyproject = parent / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    return str(parent) if f'name = "{PACKAGE}"' in text else None


def hidden_host_paths(workspace: str | Path | None, extra: Iterable[str | Path] = ()) -> list[str]:
    """Real paths that a sandbox of a task with this `workspace` must not see (see the module docstring)."""
    paths = set(package_dirs())
    paths |= {c for c in (checkout_of(p) for p in package_dirs()) if c}
    if workspace is not None:
        task_folder = Path(os.path.realpath(workspace)).parent
        if len(task_folder.parts) > 2:  # never a top-level directory such as /usr or /opt
            paths.add(str(task_folder))
    paths |= {os.path.realpath(p) for p in extra}
    return sorted(paths)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def mask_args(hidden: Iterable[str], bound: Iterable[str], keep: Iterable[str]) -> list[str]:
    """bwrap arguments covering each `hidden` folder that lies under a `bound` one with an empty
    read-only tmpfs. A hidden folder that holds a `keep` path (the interpreter, e.g. a venv inside
    the checkout) is not covered whole: each of its entries that holds no kept path is."""
    bound = [os.path.realpath(b) for b in bound]
    keep = [os.path.realpath(k) for k in keep]
    covered: list[str] = []
    pending = sorted(set(hidden))
    while pending:
        path = pending.pop(0)
        if not any(_under(path, b) for b in bound) or not os.path.isdir(path) or os.path.islink(path):
            continue
        if path in keep:  # an interpreter's folder (what lies inside it may still be covered)
            continue
        if any(_under(k, path) for k in keep):
            with os.scandir(path) as entries:
                pending += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
            continue
        covered.append(path)
    args: list[str] = []
    for path in sorted(set(covered)):
        if not any(_under(path, other) and path != other for other in covered):
            args += ["--tmpfs", path, "--remount-ro", path]
    return args
