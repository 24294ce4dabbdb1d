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
        LazyFactory("patchgym.launch.engines:sglang_backend", "pip install 'patchgym[sglang]'"),
        "SGLang servers over HTTP (native API): attach by urls, or launch a group behind the SGLang router",
    )
