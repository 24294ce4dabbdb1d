"""Registers the built-in inference backends (imported lazily: their dependencies are optional)."""

from __future__ import annotations

from typing import Any

from patchgym.core.plugins import Register, hookimpl


def _sglang(**settings: Any) -> Any:
    from patchgym.backends.inference.sglang import SGLangEngine

    return SGLangEngine(**settings)


@hookimpl
def register_inference_backends(register: Register) -> None:
    register("sglang", _sglang, "SGLang servers over HTTP (native API), several URLs or a router")
