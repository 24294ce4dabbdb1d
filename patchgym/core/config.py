"""Validated settings with helpful errors: unknown keys are refused with a suggestion.

`validate(model, data, source)` turns pydantic's errors into one `ConfigError` that lists each
problem as a dotted path, says what is wrong, and for a misspelt key names the closest known
ones ("stages.grpo.stepz: unknown key; did you mean 'steps'?").
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from patchgym.core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def _as_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model in an annotation such as `Sub`, `Sub | None` or `Optional[Sub]`."""
    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _fields_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """The field names of the sub-model reached by `path` (empty if it is not a model)."""
    current: type[BaseModel] | None = model
    for part in path:
        if isinstance(part, int):  # an item of a list of sub-models
            continue
        if current is None or part not in current.model_fields:
            return []
        current = _as_model(current.model_fields[part].annotation)
    return list(current.model_fields) if current else []


def validate(model: type[M], data: Any, source: str = "config") -> M:
    """`model.model_validate(data)`, with every error explained in one `ConfigError`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            location = tuple(error["loc"])
            where = ".".join(str(part) for part in location) or "(top level)"
            if error["type"] == "extra_forbidden":
                known = _fields_at(model, location[:-1])
                close = difflib.get_close_matches(str(location[-1]), known, n=3, cutoff=0.6)
                hint = (
                    f"did you mean {' or '.join(repr(c) for c in close)}?"
                    if close
                    else f"known keys: {', '.join(known)}"
                )
                problems.append(f"{where}: unknown key; {hint}")
            else:
                problems.append(f"{where}: {error['msg']}")
        raise ConfigError(f"invalid {source}:\n  " + "\n  ".join(problems)) from None


def load_yaml(model: type[M], path: str | Path) -> M:
    """Read and validate a YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    return validate(model, data, source=str(path))
