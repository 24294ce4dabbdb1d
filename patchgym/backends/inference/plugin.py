"""Registers the built-in inference backends (imported lazily: their dependencies are optional)."""

from __future__ import annotations

from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.inference import InferenceEngine
from patchgym.core.plugins import Register, hookimpl


def _embedded(**settings: Any) -> InferenceEngine:
    try:
        from patchgym.backends.inference.embedded import EmbeddedEngine
    except ImportError as exc:
        raise ConfigError(
            f"the embedded inference backend needs torch and transformers: pip install 'patchgym[train]' ({exc})"
        ) from exc
    return EmbeddedEngine(**settings)


def _sglang(**settings: Any) -> InferenceEngine:
    from patchgym.backends.inference.sglang import SGLangEngine

    return SGLangEngine(**settings)


@hookimpl
def register_inference_backends(register: Register) -> None:
    register("embedded", _embedded, "a transformers model in this process, continuous batching with a KV cache")
    register("sglang", _sglang, "SGLang servers over HTTP (native API), several URLs or a router")
