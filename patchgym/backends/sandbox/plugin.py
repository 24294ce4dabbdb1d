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
    register(
        "e2b",
        LazyFactory("patchgym.backends.sandbox.e2b:E2BSandboxBackend", "pip install 'patchgym[e2b]'"),
        "E2B microVMs through the e2b SDK: leases renewed while open, metadata labels, reaping",
    )
    register(
        "harbor",
        LazyFactory(
            "patchgym.backends.sandbox.harbor:HarborSandboxBackend",
            "Harbor needs Python >= 3.12: pip install 'patchgym[harbor]' there",
        ),
        "any Harbor environment provider (docker, daytona, modal, e2b, ...); Python >= 3.12",
    )
