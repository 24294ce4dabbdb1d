"""Static checks on the agent's diff: code and configuration that could fool the test runner.

A fresh sandbox does not stop code under test from patching the runner in-process, nor a changed
configuration from loading a plugin, so the agent's non-test changes are read as the interpreter
and pytest would read them: Python decoded by its own declared encoding and parsed
(`python_source`), pytest's configuration parsed as pytest parses it (`runner_config`), and
files that load at interpreter start-up or stand in for a module the runner imports flagged by
where they are (`layout`). A construct counts only where the agent added it: the constructs of
the pristine file are subtracted, so an edit to a file that already uses `sys.modules` is not a
finding, a second use is. A repository that is itself the test framework (pytest's own
`src/_pytest/`) may import and hook the framework in its own package. What a finding costs is
the grader's `tamper_policy`: "zero" (reward 0), "flag" (recorded only) or "off".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from patchgym.core.tamper import layout, names, python_source, runner_config
from patchgym.core.tree_diff import FileChange

__all__ = ["Finding", "tamper_findings", "check_change"]


@dataclass(frozen=True)
class Finding:
    """One suspicious change: where, what kind, and the text that triggered it."""

    path: str
    line: int
    what: str
    text: str

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "what": self.what, "text": self.text[:200]}


class _Tree:
    """The pristine tree's paths (where known) and the agent's changes to it."""

    def __init__(self, changes: list[FileChange], pristine: Collection[str] | None) -> None:
        self.pristine = pristine
        self.added = {c.path for c in changes if c.old is None and not c.deleted}
        self.deleted = {c.path for c in changes if c.deleted}
        self.changed = {c.path for c in changes}

        self.frameworks = {
            module
            for module in names.FRAMEWORK_MODULES
            for root in ("", "src/", "lib/")
            if self.existed(f"{root}{module}/__init__.py") or self.existed(f"{root}{module}.py")
        }
        """The test frameworks the pristine repository itself provides (pytest's repository)."""

    def existed(self, path: str) -> bool:
        if self.pristine is not None:
            return path in self.pristine
        return path in self.changed and path not in self.added

    def exists(self, path: str) -> bool:
        return path in self.added or (self.existed(path) and path not in self.deleted)


MAX_SOURCE_BYTES = 5_000_000
"""A Python file larger than this is not parsed (time and memory) but is itself a finding."""


def tamper_findings(
    changes: Iterable[FileChange],
    limit: int = 20,
    *,
    pristine: Collection[str] | None = None,
    max_source_bytes: int = MAX_SOURCE_BYTES,
) -> list[Finding]:
    """Suspicious changes among `changes` (the agent's non-test changes), at most `limit`.
    `pristine`: every path of the pristine tree, where known (to tell new top-level modules and
    the framework's own package); without it only the changes decide. A Python file over
    `max_source_bytes` is a finding rather than parsed."""
    changes = list(changes)
    tree = _Tree(changes, pristine)
    findings: list[Finding] = []
    for change in changes:
        findings.extend(
            finding
            for finding in check_change(change, tree.existed, tree.exists, max_source_bytes)
            if not _own_framework(finding, tree)
        )
        if len(findings) >= limit:
            break
    return findings[:limit]


def _own_framework(finding: Finding, tree: _Tree) -> bool:
    """An import of the framework that this repository is (pytest's docs importing pytest)."""
    if finding.what != names.IMPORTS_FRAMEWORK:
        return False
    module = finding.text.partition(": ")[2].split(".")[0]
    return module in tree.frameworks


def check_change(
    change: FileChange,
    existed: Callable[[str], bool],
    exists: Callable[[str], bool],
    max_source_bytes: int = MAX_SOURCE_BYTES,
) -> Iterator[Finding]:
    """The findings of one changed path; `existed`/`exists`: whether a path is in the pristine /
    the agent's tree."""
    path = change.path
    if layout.is_startup(path) and not change.deleted:
        yield Finding(path, 0, names.STARTUP, layout.name_of(path))
    yield from _shadowing(change, existed, exists)
    yield from _runner_config(change)
    if change.new is None:
        return
    if layout.is_env_file(path) or path.endswith((".py", ".pth")):
        yield from _runner_env(change)
    if python_source.is_python(path, change.new) and not layout.framework_package(path, existed):
        if len(change.new) > max_source_bytes:
            yield Finding(
                path, 0, names.UNPARSEABLE, f"{len(change.new)} bytes: over max_source_bytes {max_source_bytes}"
            )
        else:
            yield from _python(change)


def _shadowing(change: FileChange, existed: Callable[[str], bool], exists: Callable[[str], bool]) -> Iterator[Finding]:
    module = layout.module_name(change.path)
    if module is None or change.deleted or existed(change.path) or not layout.is_top_level(change.path, exists):
        return
    if module in names.FRAMEWORK_MODULES:
        yield Finding(change.path, 0, names.SHADOWS, module)
    elif module in names.SHADOWABLE:
        yield Finding(change.path, 0, names.SHADOWS_MODULE, module)


def _runner_config(change: FileChange) -> Iterator[Finding]:
    name = layout.config_name(change.path)
    if layout.name_of(change.path) == "conftest.py":
        yield Finding(
            change.path, 0, names.RUNNER_CONFIG, "conftest.py " + ("removed" if change.deleted else "changed")
        )
        return
    if name is None:
        return
    reads = [runner_config.entry_point_plugins]
    if name != "entry_points.txt":
        reads.insert(0, runner_config.pytest_options)
    for read in reads:
        try:
            old = read(name, change.old) if change.old is not None else None
        except runner_config.Unreadable:
            continue  # the pristine file did not parse: pytest did not read it either
        try:
            new = read(name, change.new) if change.new is not None else None
        except runner_config.Unreadable as exc:
            yield Finding(change.path, 0, names.RUNNER_CONFIG, f"no longer parses: {exc}")
            return
        if read is runner_config.entry_point_plugins:
            for plugin in sorted((new or set()) - (old or set())):  # type: ignore[operator]
                yield Finding(change.path, 0, names.PLUGIN, plugin)
        else:
            for text in runner_config.option_changes(old, new):  # type: ignore[arg-type]
                yield Finding(change.path, 0, names.RUNNER_CONFIG, text)


def _runner_env(change: FileChange) -> Iterator[Finding]:
    if change.path.endswith(".py"):
        return  # Python source is read by its parser (string constants, folded)
    old, new = (data.decode("utf-8", "replace") if data else "" for data in (change.old, change.new))
    for variable in names.RUNNER_ENV_NAMES:
        pattern = re.compile(rf"\b{variable}\b")
        if len(pattern.findall(new)) > len(pattern.findall(old)):
            yield Finding(change.path, 0, names.RUNNER_ENV, variable)


def _python(change: FileChange) -> Iterator[Finding]:
    assert change.new is not None
    new_tree = python_source.parse(change.new)
    old_tree = python_source.parse(change.old) if change.old is not None else None
    if new_tree is None:
        if change.old is None or old_tree is not None:
            # newer syntax than this interpreter's, or a deliberate error: suspect only where its
            # tokens name what the checks look for (or it does not even tokenize)
            suspicious = python_source.unparsed_names(change.new)
            if suspicious is None or suspicious:
                text = (
                    "does not tokenize"
                    if suspicious is None
                    else f"does not parse here; names {sorted(suspicious)[:5]}"
                )
                yield Finding(change.path, 0, names.UNPARSEABLE, text)
        return
    before = Counter(c.key for c in python_source.constructs(old_tree)) if old_tree is not None else Counter()
    for construct in python_source.constructs(new_tree):
        if before[construct.key] > 0:
            before[construct.key] -= 1
            continue
        yield Finding(change.path, construct.line, construct.what, construct.key)
