"""Which of a Harbor container's changes the verifier must refuse, compared by real path.

`docker diff` lists real paths (the engine walks the container's layer; no symbolic link is
followed), so a pattern written for one spelling of a path must match every spelling the image
gives it: merged-usr images make `/bin` a link to `/usr/bin`, so `/bin/*` also covers
`/usr/bin/*` (and the other way round); patterns and paths are normalised (`..`, `//`); Linux
paths are case-sensitive, so no case folding is done. A change that replaces a folder holding
protected paths (the folder made a symbolic link, or removed) is itself protected, even though
no path under it is listed. Bind mounts never reach `docker diff`: Harbor sandboxes mount nothing
the agent can write besides the container's own layer.

Protected (`PROTECTED_PATHS`): shell start-up files, Python start-up hooks, the system's Python
interpreters and test runner entry points, the whole standard library of the system's Pythons
(`/usr/lib/python3.*/` ..., site-packages and dist-packages excepted; a module added there would
shadow site-packages), the test framework in any site-packages, and pytest configuration at the
file-system root (the ancestor of `/tests`, where pytest looks for its rootdir).
`EXISTING_ONLY`: system `bin` folders, and any interpreter or standard library (a virtual
environment's), where an agent may add (`apt-get install`, a new venv) but not change or remove
what the image has.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Iterable

ALIASES = {"/bin": "/usr/bin", "/sbin": "/usr/sbin", "/lib": "/usr/lib", "/lib64": "/usr/lib64", "/lib32": "/usr/lib32"}
"""Merged-usr links: the top-level name and where it points."""

PROTECTED_PATHS = (
    "/etc/profile",
    "/etc/profile.d/*",
    "/etc/bash.bashrc",
    "/etc/environment",
    "/etc/ld.so.preload",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d/*",
    "/root/.bashrc",
    "/root/.profile",
    "/root/.bash_profile",
    "/root/.bash_login",
    "/home/*/.bashrc",
    "/home/*/.profile",
    "/home/*/.bash_profile",
    "/usr/local/bin/*",
    "/usr/local/sbin/*",
    "/usr/bin/python*",
    "/usr/bin/pytest*",
    "/usr/bin/py.test",
    "/usr/bin/pip*",
    "/usr/bin/uv",
    "/usr/bin/uvx",
    "/usr/bin/bash",
    "/usr/bin/sh",
    "/usr/bin/dash",
    "/usr/bin/env",
    "*/sitecustomize.py",
    "*/usercustomize.py",
    "*.pth",
    "/usr/lib/python[0-9]*",
    "/usr/lib64/python[0-9]*",
    "/usr/local/lib/python[0-9]*",
    "/usr/local/lib64/python[0-9]*",
    "/opt/conda/lib/python[0-9]*",
    "*/site-packages/pytest*",
    "*/site-packages/_pytest*",
    "*/site-packages/py.py",
    "*/site-packages/py/*",
    "*/site-packages/pluggy*",
    "*/site-packages/iniconfig*",
    "*/site-packages/unittest*",
    "*/dist-packages/pytest*",
    "*/dist-packages/_pytest*",
    "*/dist-packages/pluggy*",
    "*/dist-packages/iniconfig*",
    "/conftest.py",
    "/pytest.ini",
    "/.pytest.ini",
    "/tox.ini",
    "/setup.cfg",
    "/pyproject.toml",
)
"""Container paths (fnmatch patterns; `*` crosses `/`) a Harbor agent may not change; a pattern
covers what lies under a matching folder too."""

EXISTING_ONLY = (
    "/bin/*",
    "/sbin/*",
    "*/bin/python*",
    "*/bin/pytest*",
    "*/bin/py.test",
    "*/bin/pip*",
    "*/lib/python[0-9]*",
    "*/lib64/python[0-9]*",
)
"""Paths an agent may add but not change or delete: a tool in a system `bin` folder
(`apt-get install`), a new virtual environment's interpreter and standard library; the ones
the image has stay as they are."""

_PACKAGE_FOLDERS = ("/site-packages", "/dist-packages")


def spellings(path: str) -> set[str]:
    """`path` normalised, and its spelling through each merged-usr link."""
    path = posixpath.normpath("/" + path.lstrip("/")) if path else "/"
    if path.startswith("//"):
        path = path[1:]
    found = {path}
    for link, target in ALIASES.items():
        for source, destination in ((link, target), (target, link)):
            if path == source or path.startswith(source + "/"):
                found.add(destination + path[len(source) :])
    return found


def _matches(path: str, pattern: str) -> bool:
    """`path` or a folder above it matches `pattern` (a change under a protected folder)."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    folder = path
    while folder not in ("/", ""):
        folder = posixpath.dirname(folder)
        if fnmatch.fnmatchcase(folder, pattern):
            return True
    return False


def _in_stdlib(path: str, pattern: str) -> bool:
    return "/lib" in pattern and "python[0-9]*" in pattern and any(part in path for part in _PACKAGE_FOLDERS)


def _holds_protected(path: str, patterns: Iterable[str]) -> bool:
    """`path` is a folder above a protected pattern's fixed part (`/etc` for `/etc/profile.d/*`)."""
    for pattern in patterns:
        fixed = pattern.split("*", 1)[0].split("[", 1)[0].rstrip("/")
        if fixed.startswith("/") and (fixed == path or fixed.startswith(path.rstrip("/") + "/")):
            return True
    return False


def protected_changes(
    changes: Iterable[tuple[str, int]], protected: Iterable[str], existing_only: Iterable[str], allowed: Iterable[str]
) -> list[str]:
    """The changed paths (`docker diff` entries: path, kind 0 changed / 1 added / 2 deleted) the
    agent may not make, given the task's `allowed` patterns."""
    changes = list(changes)
    protected = [s for pattern in protected for s in spellings(pattern)]
    existing_only = [s for pattern in existing_only for s in spellings(pattern)]
    allowed = [s for pattern in allowed for s in spellings(pattern)]
    listed = [path for path, _ in changes]
    touched = []
    for path, kind in changes:
        names = spellings(path)
        if any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in allowed):
            continue
        hit = any(_matches(name, p) and not _in_stdlib(name, p) for name in names for p in protected)
        hit = hit or (
            kind != 1 and any(_matches(name, p) and not _in_stdlib(name, p) for name in names for p in existing_only)
        )
        # a leaf change (nothing listed under it: not merely a parent of other changes) to a
        # folder that holds protected paths replaced the folder (a link, a deletion)
        leaf = not any(other.startswith(path.rstrip("/") + "/") for other in listed)
        hit = hit or (leaf and any(_holds_protected(name, protected) for name in names))
        if hit:
            touched.append(path)
    return touched
