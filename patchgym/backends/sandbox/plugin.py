"""Registers the built-in sandbox backends (each imported on first use)."""

from __future__ import annotations

from patchgym.core.plugins import LazyFactory, Register, hookimpl


@hookimpl
def register_sandbox_backends(register: Register) -> None:
    register(
        "local",
        LazyFactory("patchgym.backends.sandbox.local:LocalSandboxBackend"),
        "workspace copies on this host, isolated with bubblewrap when available",
    )
    register(
        "docker",
        LazyFactory("patchgym.backends.sandbox.docker:DockerSandboxBackend", "pip install 'patchgym[docker]'"),
        "Docker containers (network off), warm pool, reaping of leaked containers",
    )
