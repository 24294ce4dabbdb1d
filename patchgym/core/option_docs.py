"""Descriptions of a factory's options, read from its docstring's `Args:` section.

A factory registered without an options model gets one from its signature
(`patchgym.core.plugins.options_model_of`); the descriptions come from the Google-style
`Args:` (or `Options:`) section of the class docstring, its `__init__` docstring or the
function's docstring:

    Args:
        count: tasks to generate
        cache_dir: where tasks are generated; a description may continue
            on indented lines
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Options|Parameters):\s*$")
_OTHER_SECTION = re.compile(r"^\s*(Returns|Yields|Raises|Examples?|Notes?|Attributes|Warnings?):\s*$")
_ENTRY = re.compile(r"^(\s*)(\*{0,2}\w+)(\s*\([^)]*\))?:\s*(.*)$")


def parse_args_section(doc: str | None) -> dict[str, str]:
    """`{name: description}` from the `Args:` section of one docstring (empty without one)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    found: dict[str, str] = {}
    in_section, entry_indent, current = False, -1, ""
    for line in lines:
        if not in_section:
            in_section, entry_indent = bool(_SECTION.match(line)), -1
            continue
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = _ENTRY.match(line)
        if _OTHER_SECTION.match(line) or indent < entry_indent or (entry_indent < 0 and entry is None):
            in_section = False  # the section ended
        elif entry_indent < 0 or (indent == entry_indent and entry is not None):
            assert entry is not None
            entry_indent, current = indent, entry.group(2).lstrip("*")
            found[current] = entry.group(4).strip()
        else:
            found[current] = f"{found[current]} {line.strip()}".strip()
    return found


def option_descriptions(factory: Callable[..., Any]) -> dict[str, str]:
    """The `Args:` descriptions of a factory: a class's docstring and `__init__`'s, or a function's."""
    docs: dict[str, str] = {}
    targets = [factory, factory.__init__] if inspect.isclass(factory) else [factory]  # type: ignore[misc]
    for target in targets:
        docs.update(parse_args_section(inspect.getdoc(target) if target is not object.__init__ else None))
    return docs
