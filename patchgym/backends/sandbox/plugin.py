"""Registers the built-in sandbox backends."""

from __future__ import annotations

from patchgym.core.plugins import Register, hookimpl


def _local(**settings):  # type: ignore[no-untyped-def]
    from patchgym.backends.sandbox.local import LocalSandboxBackend

    return LocalSandboxBackend(**settings)


@hookimpl
def register_sandbox_backends(register: Register) -> None:
    register("local", _local, "workspace copies on this host, isolated with bubblewrap when available")
