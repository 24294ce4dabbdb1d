"""The agent's changes to a repository, found by comparing two downloaded trees on the host.

Nothing inside the sandbox is trusted to compute them (no git, no index flags, no attributes
filters, no replace refs): the pristine tree comes from a fresh sandbox started from the task,
the agent's tree is downloaded from the sandbox it used, and the bytes are compared here.
`.git`, `__pycache__` folders and `.pyc` files never count as changes (a planted unchecked
hash-based `.pyc` would otherwise shadow a restored test file).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileChange:
    """One changed path: `old`/`new` bytes (None: absent), or a symbolic link's `new_link` target."""

    path: str
    old: bytes | None
    new: bytes | None
    new_link: str | None = None
    executable: bool = False

    @property
    def deleted(self) -> bool:
        return self.new is None and self.new_link is None

    def added_lines(self) -> list[tuple[int, str]]:
        """(line number, text) of the new file's lines that the old file does not have."""
        if self.new is None:
            return []
        old = set((self.old or b"").decode("utf-8", "replace").splitlines())
        lines = self.new.decode("utf-8", "replace").splitlines()
        return [(number, line) for number, line in enumerate(lines, 1) if line not in old]


def _ignored(relative: str) -> bool:
    parts = relative.split("/")
    return parts[0] == ".git" or "__pycache__" in parts or relative.endswith(".pyc")


def _entries(root: Path) -> dict[str, os.stat_result]:
    """Every file and symbolic link under `root` (not followed), keyed by relative POSIX path."""
    found: dict[str, os.stat_result] = {}
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        for name in dirs + files:
            path = base / name
            relative = path.relative_to(root).as_posix()
            info = path.lstat()
            if not _ignored(relative) and not stat.S_ISDIR(info.st_mode):
                found[relative] = info
        dirs[:] = [
            d for d in dirs if not (base / d).is_symlink() and not _ignored((base / d).relative_to(root).as_posix())
        ]
    return found


def _file_bytes(entries: dict[str, os.stat_result]) -> int:
    return sum(info.st_size for info in entries.values() if stat.S_ISREG(info.st_mode))


def _content(path: Path, info: os.stat_result) -> tuple[bytes | None, str | None]:
    if stat.S_ISLNK(info.st_mode):
        return None, os.readlink(path)
    if stat.S_ISREG(info.st_mode):
        return path.read_bytes(), None
    return None, None  # a FIFO or socket carries nothing into the fresh sandbox


class TreeTooLarge(Exception):
    """The changed tree holds more bytes than the pristine one plus the allowance: nothing was read."""


def tree_changes(
    pristine: Path, changed: Path, skip: Callable[[str], bool], *, max_extra_bytes: int | None = None
) -> list[FileChange]:
    """Files that differ between two trees (content, link target or executable bit), minus `skip`ped
    paths. With `max_extra_bytes`, a changed tree whose regular files hold more than that beyond the
    pristine tree's is refused (`TreeTooLarge`) before any file is read into memory."""
    before, after = _entries(pristine), _entries(changed)
    if max_extra_bytes is not None:
        extra = _file_bytes(after) - _file_bytes(before)
        if extra > max_extra_bytes:
            raise TreeTooLarge(f"the downloaded tree holds {extra} bytes more than the task's")
    changes: list[FileChange] = []
    for relative in sorted(before.keys() | after.keys()):
        if skip(relative):
            continue
        old, old_link = _content(pristine / relative, before[relative]) if relative in before else (None, None)
        new, new_link = _content(changed / relative, after[relative]) if relative in after else (None, None)
        executable = relative in after and bool(after[relative].st_mode & stat.S_IXUSR)
        was_executable = relative in before and bool(before[relative].st_mode & stat.S_IXUSR)
        if (old, old_link) == (new, new_link) and executable == was_executable:
            continue
        changes.append(FileChange(relative, old, new, new_link, executable))
    return changes


def tree_paths(root: Path) -> set[str]:
    """Every file and symbolic link under `root`, as `tree_changes` sees them (relative POSIX paths)."""
    return set(_entries(root))


def remove_tree(folder: Path) -> None:
    """Delete a downloaded tree, even parts of it made read-only."""

    def unlock(remove: Callable[[str], object], path: str, _: object) -> None:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        remove(path)

    if folder.exists():
        shutil.rmtree(folder, onerror=unlock)
