"""The `acme-team` sandbox backend: any registered backend, under ACME's sandbox policy.

It wraps a backend built through patchgym's registry (`local` by default; `docker` or `e2b` in
production) and rewrites each `SandboxSpec` before passing it on:
- every sandbox carries the label `acme.team=<team>`, so `reap({"acme.team": team})` finds all
  of a team's leftovers on any provider;
- every command sees `ACME_TEAM=<team>` and `PIP_NO_INDEX=1` (no package downloads), under the
  task's own environment;
- a task that asks for network is refused unless `allow_network` is set.
`reap` only ever touches this team's sandboxes. Everything else (exec, files, close) is the
wrapped backend's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from patchgym.core.errors import ConfigError
from patchgym.core.plugins import registry
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec

TEAM_LABEL = "acme.team"


class AcmeSandboxBackend(SandboxBackend):
    """See the module docstring. `backend_options` are the wrapped backend's settings."""

    name = "acme-team"

    def __init__(
        self,
        team: str = "acme",
        backend: str = "local",
        backend_options: Mapping[str, Any] | None = None,
        allow_network: bool = False,
    ) -> None:
        if not team:
            raise ConfigError("acme-team sandbox: `team` must be a non-empty name")
        self.team = team
        self.allow_network = allow_network
        self.inner: SandboxBackend = registry().create("sandbox", backend, **dict(backend_options or {}))

    def policy(self, spec: SandboxSpec) -> SandboxSpec:
        """`spec` with ACME's labels and environment; a refused network is a `ConfigError`."""
        if spec.network and not self.allow_network:
            raise ConfigError(
                f"team {self.team!r} sandboxes have no network: set the acme-team option allow_network=true "
                "to let tasks that ask for it have it"
            )
        env = {"ACME_TEAM": self.team, "PIP_NO_INDEX": "1", **spec.env}
        return replace(spec, env=env, labels={**spec.labels, TEAM_LABEL: self.team})

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return await self.inner.create(self.policy(spec))

    async def reap(self, labels: Mapping[str, str]) -> int:
        """Reap only this team's sandboxes."""
        return await self.inner.reap({**labels, TEAM_LABEL: self.team})

    def settings(self) -> dict[str, object]:
        return {
            "team": self.team,
            "allow_network": self.allow_network,
            "backend": self.inner.name,
            "backend_settings": self.inner.settings(),
        }

    async def aclose(self) -> None:
        await self.inner.aclose()
