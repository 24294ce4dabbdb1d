"""Fixtures of ACME's plugin tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model folder: the scripted engine only uses its tokenizer."""
    from patchgym.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny-model"))
