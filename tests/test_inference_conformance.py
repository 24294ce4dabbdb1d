"""The inference-engine contract (patchgym.testing.inference) on the built-in embedded engine.

The SGLang backend keeps the same contract against a real server in test_sglang.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from patchgym.testing.inference import InferenceEngineConformance

pytestmark = pytest.mark.usefixtures("train_extra")


class TestEmbeddedEngine(InferenceEngineConformance):
    @pytest.fixture(autouse=True)
    def _model(self, tiny_model_dir: Path) -> None:
        self.model_dir = tiny_model_dir

    def make_engine(self) -> Any:
        from patchgym.backends.inference.embedded import EmbeddedEngine

        return EmbeddedEngine(self.model_dir, max_context=64, max_batch_size=8)

    def weights(self, engine: Any) -> Any:
        return str(self.model_dir)  # a folder of safetensors, as a trainer's export writes
