"""Which paths of a repository are start-up files, runner configuration, environment files, the
framework's own source, or new top-level modules."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable

from patchgym.core.tamper.names import FRAMEWORK_MODULES
from patchgym.core.tamper.runner_config import CONFIG_FILES

STARTUP_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
SHELL_FILES = frozenset({".env", ".envrc", ".bashrc", ".profile", ".bash_profile", ".bash_login", ".zshrc"})
_EXTENSION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z0-9_-]+)*\.(so|pyd)$")
_SOURCE_ROOTS = ("", "src", "lib")
"""Folders a repository's top-level packages usually live in (the runner puts them on sys.path)."""


def name_of(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_startup(path: str) -> bool:
    """Loaded by `site` at interpreter start-up wherever it lands on a site directory."""
    name = name_of(path)
    return name in STARTUP_FILES or name.endswith(".pth")


def config_name(path: str) -> str | None:
    """The kind of pytest configuration `path` is (its file name), or None."""
    name = name_of(path)
    if name in CONFIG_FILES:
        return name
    parent = posixpath.basename(posixpath.dirname(path))
    if name == "entry_points.txt" and parent.endswith((".egg-info", ".dist-info")):
        return name
    return None


def is_env_file(path: str) -> bool:
    """A file that sets environment variables for a shell or a tool (where PYTEST_ADDOPTS may hide)."""
    name = name_of(path)
    return name in SHELL_FILES or name.endswith((".env", ".sh", ".bash", ".ini", ".cfg", ".toml")) or name == "Makefile"


def module_name(path: str) -> str | None:
    """The module name a file defines where its folder is on sys.path (`x.py`, `x/__init__.py`,
    `x.cpython-311-x86_64-linux-gnu.so`), or None for files that are not modules."""
    name = name_of(path)
    if name in ("__init__.py", "__init__.pyc") or re.match(r"^__init__\..*(so|pyd)$", name):
        folder = posixpath.basename(posixpath.dirname(path))
        return folder if folder.isidentifier() else None
    if name.endswith(".py") and name[:-3].isidentifier():
        return name[:-3]
    match = _EXTENSION.match(name)
    return match.group(1) if match else None


def is_top_level(path: str, exists: Callable[[str], bool]) -> bool:
    """Whether the module `path` defines is importable by its bare name: its package folder (for
    `x/__init__.py`, the folder above `x`) has no `__init__.py`, so any folder the runner puts
    on sys.path (the repository, `src/`, a test's root folder) makes it top-level."""
    folder = posixpath.dirname(path)
    if module_name(path) is not None and name_of(path).startswith("__init__."):
        folder = posixpath.dirname(folder)
    return not exists(posixpath.join(folder, "__init__.py") if folder else "__init__.py")


def framework_package(path: str, existed: Callable[[str], bool]) -> bool:
    """Whether `path` lies in a test framework's package that the pristine repository itself
    provides (pytest's `src/_pytest/`, pluggy's `src/pluggy/`): the repository is the framework,
    so its own source may import and hook it."""
    parts = path.split("/")
    for root in _SOURCE_ROOTS:
        prefix = [root] if root else []
        if parts[: len(prefix)] != prefix or len(parts) <= len(prefix):
            continue
        top = parts[len(prefix)]
        base = "/".join([*prefix, top])
        if top.removesuffix(".py") in FRAMEWORK_MODULES and (existed(f"{base}/__init__.py") or existed(base)):
            return True
    return False
