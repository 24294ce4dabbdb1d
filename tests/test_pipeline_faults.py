"""Fault tolerance of whole runs: faults injected at chosen points of a real pipeline (tiny model,
embedded trainer, local sandboxes, easy tasks), never by timing. After each run every trajectory
is trained on exactly once or logged as lost with its infra_error kind, the failures are counted
by kind in the step metrics, none is scored or reaches the loss, and the run ends at the right
step and policy version. (SIGKILL and resume: tests/test_pipeline.py.)

The few real-time waits are settings set small: a 1 s command timeout, a 3 s exec grace, a 5 s
HTTP request timeout, each sized for a loaded CI machine."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from patchgym.core.metrics import read_events
from patchgym.core.plugins import registry
from patchgym.pipeline.config import RunConfig
from tests.faults import (
    HANG,
    EngineFault,
    FaultySandboxBackend,
    RecordingTrainer,
    SandboxFaults,
    ScriptedFirstTurns,
    SGLangFront,
)
from tests.pipeline_support import check_group_accounting, check_grpo_accounting, merged, run_config

pytestmark = pytest.mark.usefixtures("train_extra")


def fault_config(tmp_path: Path, model: Path, *, steps: int, changes: Mapping[str, Any] = {}) -> RunConfig:
    """A short sync-mode GRPO run (no SFT, one eval episode per stage) on injected parts."""
    base = {
        "model": {"path": str(model)},
        "sandbox": {"name": "faulty"},
        "trainer": {"name": "recording"},
        "eval": {"limit": 1, "concurrency": 1},
        "grpo": {"rollout": {"mode": "sync", "min_valid_members": 1, "max_infra_retries": 1}},
        "checkpoint_every": 100,
        "metrics": {"tensorboard": False},
        "weight_sync": "tensor",  # the HTTP stand-in takes tensors (SGLang's same-host route), not a broadcast
    }
    config = run_config(tmp_path, steps=steps, sft=False, changes=merged(base, changes))
    if "options" in changes.get("inference", {}):  # another engine's options replace the embedded engine's
        config["inference"] = changes["inference"]
    return RunConfig.model_validate(config)


class Parts:
    """The injected parts of one run, registered under the names `fault_config` uses."""

    def __init__(self, tmp_path: Path, faults: SandboxFaults) -> None:
        from patchgym.backends.sandbox.local import LocalSandboxBackend
        from patchgym.backends.trainer.embedded import EmbeddedTrainer

        self.faults = faults
        self.trainer: RecordingTrainer | None = None
        root = tmp_path / "sandboxes"
        root.mkdir()

        def trainer(model: str, **options: Any) -> RecordingTrainer:
            self.trainer = RecordingTrainer(EmbeddedTrainer(model, **options))
            return self.trainer

        def sandbox(**options: Any) -> FaultySandboxBackend:
            return FaultySandboxBackend(LocalSandboxBackend(root_dir=root, **options), faults)

        reg = registry()
        reg.register("trainer", "recording", trainer)
        reg.register("sandbox", "faulty", sandbox)

    def engine(self, name: str, factory: Callable[..., Any]) -> None:
        registry().register("inference", name, factory)


async def run(config: RunConfig) -> None:
    from patchgym.pipeline.run import Pipeline

    await Pipeline(config, console=Console(file=io.StringIO())).run()


def check_end(config: RunConfig, parts: Parts) -> None:
    """The run finished GRPO at its last step, with the trainer and the engine at its version."""
    steps = config.grpo.steps
    state = json.loads((Path(config.run_dir) / "state.json").read_text())
    assert state["grpo_step"] == steps and state["version"] == steps
    assert state["stages_done"] == ["eval-base", "grpo", "eval-grpo"]
    assert parts.trainer is not None and parts.trainer.version == steps and len(parts.trainer.batches) == steps
    assert [e["infra_errors"] for e in read_events(config.run_dir, "eval")] == [0, 0]
    final = [e for e in read_events(config.run_dir, "trajectory") if e["stage"] == "eval-grpo"]
    assert final and all(e["policy_versions"] == [steps] for e in final)


def step_metrics(config: RunConfig) -> list[dict[str, Any]]:
    return read_events(config.run_dir, "step")


async def test_sandbox_lost_mid_episode_is_retried_then_excluded(tmp_path: Path, tiny_model_dir: Path) -> None:
    # Step 1's three members ask for sandboxes 0-2; sandbox 0 is lost and so is its retry (3).
    parts = Parts(tmp_path, SandboxFaults(lose={0, 3}))
    config = fault_config(tmp_path, tiny_model_dir, steps=2, changes={"grpo": {"rollout": {"group_size": 3}}})
    await run(config)
    assert parts.faults.lost == [0, 3]
    assert parts.trainer is not None
    logged = check_grpo_accounting(config.run_dir, steps=2, trained=parts.trainer.batches, on_policy=True)
    first, second = step_metrics(config)
    assert first["infra_errors_by_kind"] == {"sandbox_lost": 2}
    assert (first["infra_retries"], first["members_excluded"], first["trajectories"]) == (1, 1, 2)
    assert second["infra_errors_by_kind"] == {} and second["trajectories"] == 3
    lost = [t for t in logged[1] if t["infra_error"]]
    assert len(lost) == 2 and all(t["turns"] == 2 for t in lost), lost  # lost after the agent's turns
    assert all("closed" in t["infra_error"]["message"] for t in lost)  # reported by the backend itself
    assert [len(batch) for batch in parts.trainer.batches] == [2, 3]
    check_end(config, parts)


@pytest.mark.parametrize("replay_concurrency", [2, 6])
async def test_oracle_replays_run_at_most_replay_concurrency_at_once(
    tmp_path: Path, tiny_model_dir: Path, replay_concurrency: int
) -> None:
    """SFT's oracle replays (each an episode with its sandbox) were all started at once: 2,048 train
    tasks meant 2,048 sandboxes. At most `sft.replay_concurrency` run now (6 = no limit: a control)."""
    parts = Parts(tmp_path, SandboxFaults())
    changes = {
        "tasks": {"train": {"options": {"count": 6}}},
        "sft": {"enabled": True, "replay_concurrency": replay_concurrency},
        "grpo": {"enabled": False},
    }
    config = fault_config(tmp_path, tiny_model_dir, steps=0, changes=changes)
    await run(config)
    (traces,) = read_events(config.run_dir, "sft_traces")
    assert traces["kept"] == 6 and traces["replay_concurrency"] == replay_concurrency
    assert parts.faults.requested == 6 and parts.faults.open == 0
    if replay_concurrency < 6:
        assert parts.faults.peak_open <= replay_concurrency
    else:
        assert parts.faults.peak_open > 2  # without the limit, more than 2 ran at once here


async def test_a_discarded_group_is_logged_not_lost(tmp_path: Path, tiny_model_dir: Path) -> None:
    # Step 1's first group loses sandbox 0 with no retry, so it has too few valid members and is set aside.
    parts = Parts(tmp_path, SandboxFaults(lose={0}))
    rollout = {"group_size": 3, "min_valid_members": 3, "max_infra_retries": 0}
    config = fault_config(tmp_path, tiny_model_dir, steps=1, changes={"grpo": {"rollout": rollout}})
    await run(config)
    assert parts.trainer is not None
    logged = check_grpo_accounting(config.run_dir, steps=1, trained=parts.trainer.batches, on_policy=True)
    (step,) = step_metrics(config)
    assert step["groups_too_few_valid"] == 1 and step["infra_errors_by_kind"] == {"sandbox_lost": 1}
    set_aside = [t for t in logged[1] if t.get("discarded")]
    assert len(set_aside) == 3 and {t["discarded"] for t in set_aside} == {"groups_too_few_valid"}
    assert sum(1 for t in set_aside if t["infra_error"]) == 1 and len(parts.trainer.batches[0]) == 3
    check_end(config, parts)


async def test_hung_exec_is_infra_but_a_command_timeout_is_the_agents(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from patchgym.backends.inference.embedded import EmbeddedEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    parts = Parts(tmp_path, SandboxFaults())
    # First turns: 0 is the base evaluation's episode, 1 and 2 step 1's two members.
    script = {1: "sleep 30", 2: f": {HANG}"}
    parts.engine("scripted", lambda model, **o: ScriptedFirstTurns(EmbeddedEngine(model, **o), tokenizer, script))
    changes = {
        "inference": {"name": "scripted"},
        "env": {"command_timeout_s": 1.0, "exec_grace_s": 3.0},
    }
    config = fault_config(tmp_path, tiny_model_dir, steps=2, changes=changes)
    await run(config)
    assert parts.faults.hung == [f": {HANG}"]
    assert parts.trainer is not None
    logged = check_grpo_accounting(config.run_dir, steps=2, trained=parts.trainer.batches, on_policy=True)
    first = step_metrics(config)[0]
    assert first["infra_errors_by_kind"] == {"sandbox_lost": 1} and first["infra_retries"] == 1
    (hung,) = [t for t in logged[1] if t["infra_error"]]
    assert "did not answer within 4.0 s" in hung["infra_error"]["message"]
    # The command the agent let run too long was killed by the sandbox: data, scored and trained on.
    timed_out = [s for s in parts.trainer.batches[0] if "The command timed out after" in tokenizer.decode(s.token_ids)]
    assert len(timed_out) == 1
    check_end(config, parts)


@pytest.fixture
async def front(tiny_model_dir: Path) -> AsyncIterator[SGLangFront]:
    from patchgym.backends.inference.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_dir, max_context=1024, max_batch_size=8)
    server = await SGLangFront(engine).start()
    yield server
    await server.aclose()
    await engine.aclose()


def http_engine(parts: Parts, front: SGLangFront, faults: Mapping[int, EngineFault], **client: Any) -> dict[str, Any]:
    """Serve the run's policy through `front` with `faults`; the run's `inference` section."""
    from patchgym.backends.inference.sglang import SGLangEngine

    front.faults = dict(faults)
    parts.engine("http", lambda model, **options: SGLangEngine(front.url, **options))
    options = {"max_context": 1024, "concurrency": 4, "retry_backoff_s": 0.01, **client}
    return {"name": "http", "options": options}


async def test_engine_5xx_and_timeouts_are_retried_then_transport_errors(
    tmp_path: Path, tiny_model_dir: Path, front: SGLangFront
) -> None:
    parts = Parts(tmp_path, SandboxFaults())
    # Requests 0-1: the base evaluation's two turns; 2-5: step 1's two members, two turns each.
    faults: dict[int, EngineFault] = {2: "5xx_once", 3: "hang_once", 4: "5xx_always"}
    inference = http_engine(parts, front, faults, retries=2, request_timeout_s=5.0)
    config = fault_config(tmp_path, tiny_model_dir, steps=2, changes={"inference": inference})
    await run(config)
    assert [front.attempts[n] for n in (2, 3, 4)] == [2, 2, 3]  # recovered, recovered, gave up
    assert front.weight_versions == [1, 2]  # the weights went over HTTP too
    assert parts.trainer is not None
    logged = check_grpo_accounting(config.run_dir, steps=2, trained=parts.trainer.batches, on_policy=True)
    first, second = step_metrics(config)
    assert first["infra_errors_by_kind"] == {"transport": 1} and first["infra_retries"] == 1
    assert second["infra_errors_by_kind"] == {}
    (failed,) = [t for t in logged[1] if t["infra_error"]]
    assert "3 attempt(s)" in failed["infra_error"]["message"] and "503" in failed["infra_error"]["message"]
    check_end(config, parts)


async def test_engine_restart_mid_step_fails_requests_in_flight_and_the_run_goes_on(
    tmp_path: Path, tiny_model_dir: Path, front: SGLangFront
) -> None:
    parts = Parts(tmp_path, SandboxFaults())
    # Request 7 falls in step 2 (0-1: evaluation, 2-5: step 1); the server goes down once another
    # request is in flight too. Without client retries each request cut is an infra fault of its
    # episode, and the episodes are retried.
    inference = http_engine(parts, front, {7: "restart"}, retries=0)
    changes = {"inference": inference, "grpo": {"rollout": {"max_infra_retries": 2}}}
    config = fault_config(tmp_path, tiny_model_dir, steps=3, changes=changes)
    port = front.port
    await run(config)
    assert front.restarts == 1 and front.port == port and front.served_after_restart > 0
    assert parts.trainer is not None
    check_grpo_accounting(config.run_dir, steps=3, trained=parts.trainer.batches, on_policy=True)
    errors = [s["infra_errors_by_kind"] for s in step_metrics(config)]
    assert front.cut_requests >= 2 and errors == [{}, {"transport": front.cut_requests}, {}]
    assert front.weight_versions == [1, 2, 3]
    check_end(config, parts)


async def test_engine_restart_between_steps_is_survived_by_the_weight_sync(
    tmp_path: Path, tiny_model_dir: Path, front: SGLangFront
) -> None:
    parts = Parts(tmp_path, SandboxFaults())
    front.restart_at_pause = 0  # the server goes down as the weights of step 1 are about to be sent
    config = fault_config(tmp_path, tiny_model_dir, steps=2, changes={"inference": http_engine(parts, front, {})})
    await run(config)
    assert front.restarts == 1 and front.pauses == 3  # the cut pause was sent again, then step 2's
    assert front.weight_versions == [1, 2] and front.served_after_restart > 0
    assert parts.trainer is not None
    check_grpo_accounting(config.run_dir, steps=2, trained=parts.trainer.batches, on_policy=True)
    assert [s["infra_errors_by_kind"] for s in step_metrics(config)] == [{}, {}]
    check_end(config, parts)


async def test_every_group_is_accounted_for_with_oversampling_cancels_and_a_lost_sandbox(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # Two groups run for each one-group step (oversampling); the group of sandbox 0 loses it without a
    # retry, so it is set aside as too few valid, or as too stale for sync mode if the step's weights are
    # published first (cancelled while running, or finished and waiting: timing decides). Either way
    # every group drawn ends in one place.
    parts = Parts(tmp_path, SandboxFaults(lose={0}))
    rollout = {"oversample_groups": 1, "min_valid_members": 2, "max_infra_retries": 0}
    config = fault_config(tmp_path, tiny_model_dir, steps=3, changes={"grpo": {"rollout": rollout}})
    await run(config)
    assert parts.faults.lost == [0] and parts.trainer is not None
    check_grpo_accounting(config.run_dir, steps=3, trained=parts.trainer.batches, on_policy=True)
    totals = check_group_accounting(config.run_dir)
    assert totals["trained"] == 3 and totals["drawn"] == 3 + sum(totals["discarded"].values()) + totals["pending"]
    (lost,) = [t for t in read_events(config.run_dir, "trajectory") if t["infra_error"]]
    assert lost["discarded"] in ("groups_too_few_valid", "groups_cancelled_stale", "groups_stale")
    assert totals["discarded"][lost["discarded"]] >= 1 and totals["episodes_discarded"] >= 2
    check_end(config, parts)
