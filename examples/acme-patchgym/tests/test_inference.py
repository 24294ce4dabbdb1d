"""The acme-scripted policy keeps patchgym's inference contract and solves acme-ledger tasks."""

from __future__ import annotations

from pathlib import Path

import pytest
from patchgym.core.plugins import registry
from patchgym.envs.agent import run_agent
from patchgym.envs.swe import AsyncSWEEnv, EnvConfig
from patchgym.testing.inference import InferenceEngineConformance

from acme_patchgym.inference import ScriptedEngine
from acme_patchgym.tasks import LedgerTaskSet


class TestScriptedEngine(InferenceEngineConformance):
    """Every test of patchgym's inference-engine contract, on the scripted policy."""

    @pytest.fixture(autouse=True)
    def _model(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    def make_engine(self) -> ScriptedEngine:
        return ScriptedEngine(str(self.model_dir), max_context=64)


@pytest.mark.asyncio
@pytest.mark.parametrize(("mistake_rate", "reward"), [(0.0, 1.0), (1.0, 0.0)])
async def test_policy_reads_the_sandbox_and_solves_the_task(
    model_dir: Path, tmp_path: Path, mistake_rate: float, reward: float
) -> None:
    tasks = LedgerTaskSet(count=1, lines=4, seed=2)
    engine = ScriptedEngine(str(model_dir), mistake_rate=mistake_rate)
    backend = registry().create("sandbox", "local", root_dir=str(tmp_path))
    env = AsyncSWEEnv(tasks, backend, config=EnvConfig(max_turns=4))
    try:
        trajectory = await run_agent(env, engine, engine.tokenizer, tasks.get("acme-ledger-2-000"))
    finally:
        await env.close()
        await backend.aclose()
        await engine.aclose()
    assert trajectory.termination == "submitted" and len(trajectory.turns) == 3
    assert trajectory.reward == reward
