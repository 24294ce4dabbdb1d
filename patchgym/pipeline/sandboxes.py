"""Every sandbox of a run carries the run's label, so that what a killed run left behind (containers,
`/tmp/patchgym-*` folders, cloud sandboxes) can be found and removed by that label alone, never
touching the sandboxes of other runs on the same machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec

RUN_LABEL = "patchgym.run"


class RunLabelledBackend(SandboxBackend):
    """The wrapped backend, adding `{RUN_LABEL: run_id}` to the labels of every sandbox it creates."""

    def __init__(self, inner: SandboxBackend, run_id: str) -> None:
        self.inner, self.run_id = inner, run_id
        self.name = getattr(inner, "name", type(inner).__name__)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        labels = {**spec.labels, RUN_LABEL: self.run_id}
        return await self.inner.create(dataclasses.replace(spec, labels=labels))

    async def reap(self, labels: Mapping[str, str]) -> int:
        return await self.inner.reap(labels)

    async def reap_run(self) -> int:
        """Remove every sandbox this run's label is on (left by an earlier, killed process of the run)."""
        return await self.inner.reap({RUN_LABEL: self.run_id})

    def settings(self) -> dict[str, object]:
        return self.inner.settings()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # backend-specific attributes (settings, pools) stay reachable
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
