"""The acme-team sandbox passes patchgym's sandbox conformance suite and applies ACME's policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from patchgym.core.errors import ConfigError
from patchgym.core.sandbox import SandboxSpec
from patchgym.testing.sandbox import SandboxConformance, make_workspace

from acme_patchgym.sandbox import TEAM_LABEL, AcmeSandboxBackend


def make_acme(root: Path, **settings: object) -> AcmeSandboxBackend:
    return AcmeSandboxBackend(team="conformance", backend_options={"root_dir": str(root)}, **settings)  # type: ignore[arg-type]


class TestAcmeTeamSandbox(SandboxConformance):
    """Every test of patchgym's sandbox contract, on the acme-team backend."""

    def make_backend(self, root: Path) -> AcmeSandboxBackend:
        return make_acme(root)


@pytest.mark.asyncio
async def test_policy_labels_and_environment(tmp_path: Path) -> None:
    backend = make_acme(tmp_path)
    try:
        spec = SandboxSpec(workspace=make_workspace(tmp_path / "ws"), env={"PIP_NO_INDEX": "0"}, labels={"run": "r"})
        assert backend.policy(spec).labels == {"run": "r", TEAM_LABEL: "conformance"}
        async with await backend.create(spec) as box:
            seen = await box.exec('echo "$ACME_TEAM $PIP_NO_INDEX"', timeout_s=30)
        assert seen.stdout == "conformance 0\n", "the task's own environment wins over the policy's defaults"
        assert backend.settings()["backend"] == "local" and backend.settings()["allow_network"] is False
    finally:
        await backend.aclose()


@pytest.mark.asyncio
async def test_network_is_refused_unless_allowed(tmp_path: Path) -> None:
    spec = SandboxSpec(workspace=make_workspace(tmp_path / "ws"), network=True)
    strict, open_ = make_acme(tmp_path), make_acme(tmp_path, allow_network=True)
    try:
        with pytest.raises(ConfigError, match="allow_network"):
            await strict.create(spec)
        async with await open_.create(spec) as box:
            assert (await box.exec("true", timeout_s=30)).ok
    finally:
        await strict.aclose()
        await open_.aclose()


@pytest.mark.asyncio
async def test_reap_touches_only_this_teams_sandboxes(tmp_path: Path) -> None:
    backend = make_acme(tmp_path)
    spec = SandboxSpec(workspace=make_workspace(tmp_path / "ws"), labels={"run": "r"})
    try:
        ours = await backend.create(spec)
        foreign = await backend.inner.create(spec)  # the same provider, outside the team's policy
        assert await backend.reap({"run": "r"}) == 1
        assert (await foreign.exec("echo alive", timeout_s=30)).stdout == "alive\n"
        await ours.close()
        await foreign.close()
    finally:
        await backend.aclose()
