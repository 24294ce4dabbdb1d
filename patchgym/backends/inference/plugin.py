"""Registers the built-in inference backends (each imported on first use)."""

from __future__ import annotations

from patchgym.core.plugins import LazyFactory, Register, hookimpl


@hookimpl
def register_inference_backends(register: Register) -> None:
    register(
        "embedded",
        LazyFactory("patchgym.backends.inference.embedded:EmbeddedEngine", "pip install 'patchgym[train]'"),
        "a transformers model in this process, continuous batching with a KV cache",
    )
    register(
        "sglang",
        LazyFactory("patchgym.backends.inference.sglang:SGLangEngine"),
        "SGLang servers over HTTP (native API), several URLs or a router",
    )
