"""The recording endpoint: an OpenAI-compatible `/v1/chat/completions` in front of the run's engine.

Bound to 127.0.0.1, it answers external agent scaffolds with whatever `InferenceEngine` the run
uses (embedded or SGLang) through the engine's tokenizer and chat template. Every episode gets
its own API key (`open`); the key selects the episode's `EpisodeRecorder`, which records exact
tokens and log-probs (patchgym.envs.recording). A closed or unknown key is refused with 401, and
so is every call after the engine failed during the episode (the scaffold's client gives up at
once instead of retrying); a spent token budget is refused with OpenAI's context-length error.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from patchgym.backends.inference.openai_server import ChatCompletionsServer, HTTPError
from patchgym.core.chat import ChatTokenizer
from patchgym.core.errors import InfraError
from patchgym.core.inference import InferenceEngine
from patchgym.envs.recording import CapReached, EpisodeRecorder, RecordingLimits


class RecordingEndpoint:
    """One server for the run, one key and recorder per episode (see the module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: ChatTokenizer,
        limits: RecordingLimits,
        *,
        model_name: str = "patchgym-policy",
        port: int = 0,
    ) -> None:
        self.engine, self.tokenizer, self.limits, self.model_name = engine, tokenizer, limits, model_name
        self._recorders: dict[str, EpisodeRecorder] = {}
        self._failed: dict[str, InfraError] = {}
        self.server = ChatCompletionsServer(keyed_handler=self._handle, model_name=model_name, port=port)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL scaffolds are given (`http://127.0.0.1:PORT/v1`)."""
        return self.server.url

    async def start(self) -> RecordingEndpoint:
        await self.server.start()
        return self

    async def aclose(self) -> None:
        await self.server.aclose()

    def settings(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model_name": self.model_name, **vars(self.limits)}

    def open(self, limits: RecordingLimits | None = None) -> tuple[str, EpisodeRecorder]:
        """A new episode (with its own sampling and caps, else the endpoint's): its key and its recorder."""
        key = f"pg-{secrets.token_urlsafe(18)}"
        recorder = EpisodeRecorder(self.engine, self.tokenizer, limits or self.limits, self.model_name)
        self._recorders[key] = recorder
        return key, recorder

    def close(self, key: str) -> InfraError | None:
        """End the episode of `key` (later calls with it are refused); returns the engine fault it hit, if any."""
        self._recorders.pop(key, None)
        return self._failed.pop(key, None)

    async def _handle(self, request: Mapping[str, Any], key: str | None) -> dict[str, Any]:
        recorder = self._recorders.get(key or "")
        if recorder is None or key in self._failed:
            raise HTTPError(401, "unknown or closed API key: every episode has its own key, valid while it runs")
        try:
            return await recorder.complete(request)
        except CapReached as exc:  # litellm and openai clients read this wording as a context-window error
            raise HTTPError(400, f"This model's maximum context length is exceeded: {exc}") from None
        except InfraError as exc:
            assert key is not None
            self._failed[key] = exc
            raise HTTPError(401, f"the inference engine failed during this episode: {exc}") from None
