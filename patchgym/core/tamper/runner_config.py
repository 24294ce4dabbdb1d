"""pytest's configuration parsed as pytest reads it, and what an agent's change to it reaches.

`pyproject.toml` is read with `tomllib` (so `"tool"."pytest".ini_options` and
`tool.pytest.ini_options` are one table; pytest 9's native `[tool.pytest]` too); `pytest.ini`,
`.pytest.ini`, `tox.ini` (`[pytest]`) and `setup.cfg` (`[tool:pytest]`) with `configparser`.
A changed option that reaches the runner (`addopts`, plugins, paths, collection patterns,
`xfail_strict`, a warning filter that stops being an error ...) is a finding; so is a pytest
configuration added where there was none (pytest reads the first it finds, so a new one
replaces the old), one removed, one that no longer parses, and a `pytest11` entry point (a
plugin that pytest loads from an installed distribution, `*.egg-info/entry_points.txt` of an
editable install included)."""

from __future__ import annotations

import configparser
import tomllib
from collections.abc import Iterator
from typing import Any

INI_SECTIONS = {"pytest.ini": "pytest", ".pytest.ini": "pytest", "tox.ini": "pytest", "setup.cfg": "tool:pytest"}
CONFIG_FILES = frozenset({*INI_SECTIONS, "pyproject.toml"})
HARMLESS_OPTIONS = frozenset(
    {
        "markers",
        "minversion",
        "console_output_style",
        "cache_dir",
        "faulthandler_timeout",
        "tmp_path_retention_count",
        "tmp_path_retention_policy",
        "verbosity_assertions",
        "verbosity_test_cases",
        "truncation_limit_lines",
        "truncation_limit_chars",
        "asyncio_default_fixture_loop_scope",
        "log_level",
        "log_format",
        "log_date_format",
        "log_cli",
        "log_cli_level",
        "log_cli_format",
        "log_cli_date_format",
        "log_file",
        "log_file_level",
        "log_file_format",
        "log_file_date_format",
        "log_auto_indent",
    }
)
"""Options that change what pytest prints, not what it runs or how it judges; any other changed
option (`addopts`, `-p`/`plugins`, `pythonpath`, `python_*`, `testpaths`, `confcutdir`,
`norecursedirs`, `xfail_strict`, `usefixtures`, `doctest_*`, `required_plugins`, `env` ...) is a
finding. `filterwarnings` is judged entry by entry (`filterwarnings_findings`)."""

Options = dict[str, Any]


class Unreadable(Exception):
    """The file does not parse as pytest would read it."""


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise Unreadable(str(exc)) from None


def _ini(data: bytes) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str.lower  # type: ignore[assignment,method-assign]
    try:
        parser.read_string(_decode(data))
    except configparser.Error as exc:
        raise Unreadable(str(exc).splitlines()[0]) from None
    return parser


def pytest_options(name: str, data: bytes) -> Options | None:
    """The pytest options of one configuration file (None: it holds no pytest configuration)."""
    if name == "pyproject.toml":
        try:
            document = tomllib.loads(_decode(data))
        except tomllib.TOMLDecodeError as exc:
            raise Unreadable(str(exc)) from None
        tool = document.get("tool", {})
        table = tool.get("pytest") if isinstance(tool, dict) else None
        if not isinstance(table, dict):
            return None
        options = {key: value for key, value in table.items() if key != "ini_options"}
        ini = table.get("ini_options")
        if isinstance(ini, dict):
            options.update(ini)
        return options
    parser = _ini(data)
    section = INI_SECTIONS[name]
    if name in ("pytest.ini", ".pytest.ini"):
        # pytest takes a pytest.ini even without a [pytest] section, so its presence alone counts
        return dict(parser.items(section)) if parser.has_section(section) else {}
    return dict(parser.items(section)) if parser.has_section(section) else None


def entry_point_plugins(name: str, data: bytes) -> set[str]:
    """`pytest11` entry points a file declares (pyproject.toml, setup.cfg, entry_points.txt)."""
    if name == "pyproject.toml":
        try:
            project = tomllib.loads(_decode(data)).get("project", {})
        except tomllib.TOMLDecodeError as exc:
            raise Unreadable(str(exc)) from None
        groups = project.get("entry-points", {}) if isinstance(project, dict) else {}
        group = groups.get("pytest11", {}) if isinstance(groups, dict) else {}
        return {f"{k} = {v}" for k, v in group.items()} if isinstance(group, dict) else set()
    parser = _ini(data)
    if name == "entry_points.txt":
        return {f"{k} = {v}" for k, v in parser.items("pytest11")} if parser.has_section("pytest11") else set()
    if name == "setup.cfg" and parser.has_option("options.entry_points", "pytest11"):
        lines = parser.get("options.entry_points", "pytest11").splitlines()
        return {line.strip() for line in lines if line.strip()}
    return set()


def _filters(value: Any) -> list[str]:
    if isinstance(value, str):
        return [line.strip() for line in value.splitlines() if line.strip()]
    return [str(item).strip() for item in value] if isinstance(value, list) else [str(value)]


def filterwarnings_findings(old: Any, new: Any) -> list[str]:
    """Warning filters that turn an error into something else: an `error` entry removed, or an
    entry added that silences every warning (no category and no message)."""
    before, after = _filters(old or []), _filters(new or [])
    problems = [
        f"removes filterwarnings {entry!r}" for entry in before if entry not in after and entry.startswith("error")
    ]
    for entry in after:
        if entry in before:
            continue
        action, _, rest = entry.partition(":")
        if action.strip() != "error" and not rest.replace(":", "").strip():
            problems.append(f"adds filterwarnings {entry!r}")
    return problems


def option_changes(old: Options | None, new: Options | None) -> Iterator[str]:
    """What changed between two files' pytest options that reaches the runner."""
    if old is None and new is not None:
        yield "adds a pytest configuration" + (f" ({', '.join(sorted(new))})" if new else "")
        old = {}
    if new is None:
        if old is not None:
            yield "removes a pytest configuration"
        return
    assert old is not None
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key) or key in HARMLESS_OPTIONS:
            continue
        if key == "filterwarnings":
            yield from filterwarnings_findings(old.get(key), new.get(key))
        else:
            yield f"{key} = {str(new.get(key, '(removed)'))[:120]}"
