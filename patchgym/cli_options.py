"""Options given on the command line as KEY=VALUE pairs (shared by every command module)."""

from __future__ import annotations

from typing import Any

import yaml

from patchgym.core.errors import ConfigError


def parse_options(items: list[str] | None) -> dict[str, Any]:
    """KEY=VALUE pairs; values are read as YAML scalars (8 → int, true → bool, text → str)."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {item!r}")
        options[key] = yaml.safe_load(value) if value else ""
    return options
