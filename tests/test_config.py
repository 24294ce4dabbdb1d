"""Validated settings: clear errors with suggestions for misspelt keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from patchgym.core.config import load_yaml, validate
from patchgym.core.errors import ConfigError


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = 1
    learning_rate: float = 1e-5


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "x"
    grpo: Inner = Inner()
    maybe: Inner | None = None


def test_misspelt_keys_get_suggestions_at_any_depth() -> None:
    with pytest.raises(ConfigError) as caught:
        validate(Outer, {"nmae": "a", "grpo": {"stepz": 3}, "maybe": {"learning_rat": 1}})
    message = str(caught.value)
    assert "nmae: unknown key; did you mean 'name' or 'maybe'?" in message
    assert "grpo.stepz: unknown key; did you mean 'steps'?" in message
    assert "maybe.learning_rat: unknown key; did you mean 'learning_rate'?" in message


def test_unrelated_keys_list_the_known_ones_and_type_errors_say_what() -> None:
    with pytest.raises(ConfigError, match=r"zzz: unknown key; known keys: name, grpo, maybe") as caught:
        validate(Outer, {"zzz": 1, "grpo": {"steps": "many"}})
    assert "grpo.steps: Input should be a valid integer" in str(caught.value)


def test_yaml_files(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("name: run\ngrpo:\n  steps: 5\n")
    assert load_yaml(Outer, good).grpo.steps == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(Outer, bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(Outer, tmp_path / "missing.yaml")
