"""Generated task families (`easy`, `locate`): written once per (family, version, split, seed, count)
into a cache folder in patchgym's task-folder format, then loaded from there."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from patchgym.core.errors import ConfigError
from patchgym.plugins.folder import FolderTaskSet

SPLIT_SEEDS = {"train": 0, "eval": 1_000_003}
"""Per-split offsets of the generators' seeds: `train` and `eval` never share a task."""

Generate = Callable[[Path, int, int, str], None]
"""`generate(directory, count, seed, split)` writes `count` task folders into `directory`."""


def sed_escape(text: str) -> str:
    """`text` as a literal in a sed pattern or replacement between `/` delimiters."""
    return "".join(f"\\{c}" if c in r"\/.*[]^$&" else c for c in text)


def generated_task_set(
    family: str, version: int, generate: Generate, *, count: int, seed: int, split: str, cache_dir: str | None
) -> FolderTaskSet:
    """The `family` tasks of `split`, generated into the cache (`PATCHGYM_CACHE` or the temp dir) if missing."""
    if split not in SPLIT_SEEDS:
        raise ConfigError(f"{family} task set split must be one of {', '.join(SPLIT_SEEDS)}, got {split!r}")
    if count < 1:
        raise ConfigError(f"{family} task set count must be >= 1, got {count}")
    root = Path(cache_dir or os.environ.get("PATCHGYM_CACHE", Path(tempfile.gettempdir()) / "patchgym-cache"))
    target = root / f"{family}-v{version}-{split}-{seed}-{count}"
    if not target.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=root))
        generate(staging, count, seed, split)
        try:
            staging.rename(target)
        except OSError:  # another process generated it first
            shutil.rmtree(staging, ignore_errors=True)
    return FolderTaskSet(target, name=f"{family}-{split}")
