"""Registers the built-in sandbox backends."""

from __future__ import annotations

from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import Register, hookimpl
from patchgym.core.sandbox import SandboxBackend


def _local(**settings: Any) -> SandboxBackend:
    from patchgym.backends.sandbox.local import LocalSandboxBackend

    return LocalSandboxBackend(**settings)


def _docker(**settings: Any) -> SandboxBackend:
    try:
        from patchgym.backends.sandbox.docker import DockerSandboxBackend
    except ImportError as exc:
        raise ConfigError(
            f"the docker sandbox backend needs the docker SDK: pip install 'patchgym[docker]' ({exc})"
        ) from exc
    return DockerSandboxBackend(**settings)


def _e2b(**settings: Any) -> SandboxBackend:
    try:
        from patchgym.backends.sandbox.e2b import E2BSandboxBackend
    except ImportError as exc:
        raise ConfigError(f"the e2b sandbox backend needs the e2b SDK: pip install 'patchgym[e2b]' ({exc})") from exc
    return E2BSandboxBackend(**settings)


def _harbor(**settings: Any) -> SandboxBackend:
    try:
        from patchgym.backends.sandbox.harbor import HarborSandboxBackend
    except ImportError as exc:
        raise ConfigError(
            f"the harbor sandbox backend needs Python >= 3.12 and Harbor: pip install 'patchgym[harbor]' ({exc})"
        ) from exc
    return HarborSandboxBackend(**settings)


@hookimpl
def register_sandbox_backends(register: Register) -> None:
    register("local", _local, "workspace copies on this host, isolated with bubblewrap when available")
    register("docker", _docker, "Docker containers (network off), warm pool, reaping of leaked containers")
    register("e2b", _e2b, "E2B microVMs through the e2b SDK: leases renewed while open, metadata labels, reaping")
    register("harbor", _harbor, "any Harbor environment provider (docker, daytona, modal, e2b, ...); Python >= 3.12")
