"""The production stack as the main job: `patchgym run configs/megatron-sglang.yaml` at tiny sizes.

Megatron TP=2 (rank 1 started by the run), 2 SGLang CPU engines behind the SGLang router, all
started, health-checked and stopped by `patchgym run`; weights broadcast from trainer rank 0 to
both engines after every step and checked by probe log-probs (verify_sync). Then the kill tests:
one engine SIGKILLed mid-GRPO (the run stops at the next sync naming it, `--resume` finishes),
and the driver stopped by SIGINT or SIGKILL (nothing it started survives).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchgym.core.metrics import read_events
from tests.pipeline_support import check_grpo_accounting, merged
from tests.test_launch import (
    STOP_BOUND_S,
    descendants,
    kill_quietly,
    patchgym_run,
    recorded_pids,
    wait_for_event,
    wait_gone,
)
from tests.test_sglang import require_sglang_venv

pytestmark = [pytest.mark.timeout(2400), pytest.mark.usefixtures("train_extra")]

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "megatron-sglang.yaml"
SYNC_TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def sglang_venv() -> Path:
    pytest.importorskip("megatron.core")
    return require_sglang_venv()


def stack_config(tmp_path: Path, steps: int, trainer: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """The shipped config at CI sizes (few tasks, short turns, tiny batches); its path and run dir."""
    config = yaml.safe_load(CONFIG.read_text())
    cache = str(tmp_path / "cache")
    small = {
        "run_dir": str(tmp_path / "run"),
        "tasks": {
            "train": {"options": {"count": 4, "cache_dir": cache}},
            "eval": {"options": {"count": 2, "cache_dir": cache}},
        },
        "sandbox": {"options": {"isolation": "none"}},
        # every decode step logged: tests read from the logs which engines generated
        "inference": {
            "options": {
                "concurrency": 4,
                "launch": {"max_total_tokens": 8192, "extra_args": ["--decode-log-interval", "1"]},
            }
        },
        "trainer": {"options": {"micro_batch_tokens": 2048, "warmup_steps": 0, "timeout_s": 300, **(trainer or {})}},
        "env": {"max_turns": 2},
        "agent": {"max_new_tokens_per_turn": 16, "max_tokens_per_trajectory": 512},
        "sft": {"epochs": 1, "batch_size": 4},
        "grpo": {"steps": steps, "rollout": {"group_size": 2, "batch_groups": 1, "concurrency": 4}},
        "eval": {"attempts": 1, "concurrency": 4},
        "checkpoint_every": 1,
        "verify_sync_tolerance": SYNC_TOLERANCE,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(merged(config, small)))
    return path, tmp_path / "run"


def check_syncs(run_dir: Path, groups: int = 1) -> list[dict[str, Any]]:
    """Every sync reached both engines (their reported versions), by broadcast over one group per
    trainer pipeline stage, within the probe bound."""
    syncs = read_events(run_dir, "weight_sync")
    versions = [s["version"] for s in syncs]  # a resumed run sends its checkpoint's version again
    assert versions == sorted(versions) and sorted(set(versions)) == list(range(1, versions[-1] + 1))
    for sync in syncs:
        assert sync["mode"] == "distributed" and sync["bytes"] > 0 and sync["groups"] == groups
        assert sync["engine_versions"] == [sync["version"]] * 2, sync
        assert sync["logprob_gap"] is not None and sync["logprob_gap"] <= SYNC_TOLERANCE, sync
    return syncs


def test_megatron_sglang_config_runs_sft_grpo_and_eval(tmp_path: Path) -> None:
    steps = 3
    config, run_dir = stack_config(tmp_path, steps)
    process = patchgym_run(str(config), log=tmp_path / "run.log")
    try:
        process.wait(2000)
    finally:
        kill_quietly(process)
    output = (tmp_path / "run.log").read_text()
    assert process.returncode == 0, output[-4000:]
    (launch,) = read_events(run_dir, "launch")
    engines = launch["inference"]
    assert len(engines["urls"]) == 2 and engines["router_url"].startswith("http://127.0.0.1:")
    assert engines["ranks_per_engine"] == [1, 1] and engines["launch"]["cpu_venv"]
    assert engines["router"]["policy"] == "cache_aware"
    for engine in ("sglang-engine-0", "sglang-engine-1"):  # the router spread the rollouts over both
        assert "Decode batch" in (run_dir / "logs" / "sglang" / f"{engine}.log").read_text(), engine
    assert launch["trainer"]["tp"] == 2 and launch["trainer"]["ranks_started_by"] == "patchgym"
    assert launch["weight_sync"]["mode"] == "distributed" and launch["weight_sync"]["verify"]
    syncs = check_syncs(run_dir)
    assert [s["version"] for s in syncs] == list(range(1, steps + 2))  # after SFT, then after every GRPO step
    step_events = read_events(run_dir, "step")
    assert [s["weight_sync"]["version"] for s in step_events] == [s["version"] for s in syncs[1:]]
    assert all(s["timings"]["weight_sync_s"] == s["weight_sync"]["seconds"] for s in step_events)
    check_grpo_accounting(run_dir, steps=steps)
    assert [e["stage"] for e in read_events(run_dir, "eval")] == ["base", "sft", "grpo"]
    names = {c["name"] for r in run_dir.glob("logs/*/processes.json") for c in json.loads(r.read_text())["children"]}
    assert names == {"sglang-engine-0", "sglang-engine-1", "sglang-router", "trainer-rank-1"}
    assert wait_gone(recorded_pids(run_dir)) == []


def test_engine_killed_mid_grpo_stops_the_run_at_the_sync_and_resume_finishes(tmp_path: Path) -> None:
    """Policy: the step under way finishes on the surviving engine (requests cut by the kill are
    retried), then the weight sync finds the dead engine and stops the run naming it; the last
    checkpoint resumes. Megatron PP=2 here: one weight group per pipeline stage."""
    steps = 3
    config, run_dir = stack_config(tmp_path, steps, trainer={"tp": 1, "pp": 2})
    process = patchgym_run(str(config), log=tmp_path / "first.log")
    try:
        wait_for_event(run_dir, "step", process)
        records = json.loads((run_dir / "logs/sglang/processes.json").read_text())["children"]
        (engine,) = [c for c in records if c["name"] == "sglang-engine-1"]
        os.kill(engine["pid"], signal.SIGKILL)
        process.wait(1500)
    finally:
        kill_quietly(process)
    output = (tmp_path / "first.log").read_text()
    assert process.returncode != 0, output[-4000:]
    assert "sglang-engine-1" in output and "signal 9" in output, output[-4000:]
    assert wait_gone(recorded_pids(run_dir)) == []
    stopped_at = json.loads((run_dir / "state.json").read_text())["grpo_step"]
    assert 1 <= stopped_at < steps

    resumed = patchgym_run("--resume", str(run_dir), log=tmp_path / "resume.log")
    try:
        resumed.wait(2000)
    finally:
        kill_quietly(resumed)
    assert resumed.returncode == 0, (tmp_path / "resume.log").read_text()[-4000:]
    check_grpo_accounting(run_dir, steps=steps)
    assert len(read_events(run_dir, "launch")) == 2
    check_syncs(run_dir, groups=2)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_stopping_the_driver_leaves_no_process_behind(tmp_path: Path, stop: signal.Signals) -> None:
    config, run_dir = stack_config(tmp_path, steps=50)
    process = patchgym_run(str(config), log=tmp_path / "run.log")
    try:
        wait_for_event(run_dir, "launch", process)  # every server healthy, every rank joined
        started = descendants(process.pid) | set(recorded_pids(run_dir))
        assert len(recorded_pids(run_dir)) == 4
        process.send_signal(stop)
        process.wait(STOP_BOUND_S)
    finally:
        kill_quietly(process)
    assert process.returncode != 0
    assert wait_gone(started) == [], (tmp_path / "run.log").read_text()[-3000:]
