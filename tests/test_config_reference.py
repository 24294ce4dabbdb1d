"""The configuration reference (docs/configuration.md) is generated from the schema and complete."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from patchgym import config_reference
from patchgym.core.option_docs import option_descriptions, parse_args_section
from patchgym.core.plugins import Registration, options_model_of
from patchgym.pipeline.config import RunConfig


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="the page is generated on Python 3.11 (CI's main venv), where the harbor sandbox cannot be imported",
)
def test_committed_page_is_what_the_schema_gives() -> None:
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/configuration.md is stale: run `python -m patchgym.config_reference --write`"
    )


def test_no_key_or_builtin_option_lacks_a_description() -> None:
    assert config_reference.empty_descriptions() == []


def test_every_run_config_key_and_builtin_option_is_on_the_page() -> None:
    page = config_reference.render()
    for _, key, *_ in config_reference.run_config_rows():
        assert f"| `{key}` |" in page
    for part in config_reference.builtin_parts():
        assert f"#### `{part.name}`" in page
        for option, *_ in config_reference.part_rows(part):
            assert f"| `{option}` |" in page
    assert "| `device` | str | 'auto' |" in page  # the embedded engine and trainer


def test_an_empty_description_is_found() -> None:
    class Bare(BaseModel):
        steps: int = 3
        told: int = Field(1, description="said")

    rows = list(config_reference.config_fields(Bare))
    assert [config_reference.description(info, sub) for _, info, sub in rows] == ["", "said"]

    def factory(count: int = 1, seed: int = 0) -> None:
        """Args:
        count: how many
        """

    model = options_model_of(factory, "f")
    part = Registration("task_set", "f", factory, "builtin-x", "", model)
    assert [text for *_, text in config_reference.part_rows(part)] == ["how many", ""]


def test_types_and_defaults_read_as_yaml() -> None:
    assert config_reference.type_name(int | None) == "int | None"
    assert config_reference.type_name(Literal["a", "b"]) == "'a' | 'b'"
    assert config_reference.type_name(list[str]) == "list[str]"
    rows = {key: (kind, default) for _, key, kind, default, _ in config_reference.run_config_rows()}
    assert rows["seed"] == ("int", "0")
    assert rows["sandbox"][1] == "{name: 'local'}"
    assert rows["tasks"][1] == "(required)"
    assert rows["sft.traces"][1] == "[{format: 'oracle'}]"
    assert rows["env.system_prompt"][1].endswith("…")
    assert set(RunConfig.model_fields) <= {key for key in rows}


def test_args_sections_are_parsed_with_continuations() -> None:
    doc = """Summary.

    Args:
        count: tasks to generate
        cache_dir (str): where they go;
            continued here
        **extra: passed on

    Returns:
        not an option: ignored
    """
    assert parse_args_section(doc) == {
        "count": "tasks to generate",
        "cache_dir": "where they go; continued here",
        "extra": "passed on",
    }
    assert parse_args_section("No section.\n\n    count: not in a section") == {}


def test_a_plugins_docstring_describes_its_options() -> None:
    class Backend:
        """A backend.

        Args:
            size: how big
        """

        def __init__(self, *, size: int = 2, depth: int = 1) -> None:
            """Args:
            depth: how deep
            """

    assert option_descriptions(Backend) == {"size": "how big", "depth": "how deep"}
    fields = options_model_of(Backend, "b").model_fields
    assert (fields["size"].description, fields["size"].default) == ("how big", 2)
    assert fields["depth"].description == "how deep"


def test_the_check_flag_fails_on_a_stale_page(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(config_reference, "PAGE", tmp_path / "configuration.md")
    assert config_reference.main(["--check"]) == 1
    assert config_reference.main(["--write"]) == 0
    assert config_reference.main(["--check"]) == 0


def test_the_module_runs_as_a_script() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "patchgym.config_reference"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("# Configuration reference")
