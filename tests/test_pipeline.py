"""`patchgym run`: the whole pipeline on a tiny model, and resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from patchgym.core.metrics import read_events
from tests.pipeline_support import check_grpo_accounting, run_config

pytestmark = pytest.mark.usefixtures("train_extra")


def write_config(tmp_path: Path, *, steps: int, sft: bool = True) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path, steps=steps, sft=sft)))
    return path


def test_full_run_writes_events_checkpoints_and_a_report(tmp_path: Path) -> None:
    from patchgym.cli import app

    result = CliRunner().invoke(app, ["run", str(write_config(tmp_path, steps=2))])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    evals = {e["stage"]: e for e in read_events(run, "eval")}
    assert set(evals) == {"base", "sft", "grpo"} and all(e["tasks"] == 2 for e in evals.values())
    steps = read_events(run, "step")
    assert [s["step"] for s in steps] == [1, 2]
    check_grpo_accounting(run, steps=2)
    for step in steps:
        assert set(step["timings"]) == {"actor_update_s", "rollout_wait_s", "logprob_recompute_s", "weight_sync_s"}
        assert step["limits"]["group_size"] == 2
        assert step["trainer"]["lr"] == pytest.approx(1e-4)  # each stage has its own learning rate
    assert all(s["lr"] == pytest.approx(2e-3) for s in read_events(run, "sft_step"))
    assert steps[0]["trainer"]["logprob_gap"] < 1e-4  # first batch: sampled with the weights being trained
    sft = read_events(run, "sft_traces")[0]
    assert sft["made"] == 4 and sft["kept"] == 4  # the oracle replays all succeed
    state = json.loads((run / "state.json").read_text())
    assert state["stages_done"] == ["eval-base", "sft", "eval-sft", "grpo", "eval-grpo"] and state["grpo_step"] == 2
    assert (run / "checkpoints" / "latest").is_dir() and list((run / "tensorboard").iterdir())
    assert "held-out evaluation" in result.output
    report = CliRunner().invoke(app, ["report", str(run)])
    assert report.exit_code == 0 and (run / "report" / "reward.png").exists()


def test_misspelt_config_keys_are_clear_errors(tmp_path: Path) -> None:
    from patchgym.cli import app

    path = write_config(tmp_path, steps=1)
    data = yaml.safe_load(path.read_text())
    data["grpo"]["stepz"] = data["grpo"].pop("steps")
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "grpo.stepz: unknown key; did you mean 'steps'?" in result.output
    data["grpo"]["steps"] = data["grpo"].pop("stepz")
    data["agent"]["temperature"] = 0.0
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "GRPO learns from sampled rollouts" in " ".join(result.output.split())


def test_resume_after_sigkill_loses_and_repeats_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path, steps=4, sft=False)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "patchgym.cli", "run"]
    driver = subprocess.Popen([*command, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {}
            if state.get("grpo_step", 0) >= 2:
                break
            assert driver.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    killed_at = json.loads((run / "state.json").read_text())["grpo_step"]
    assert 2 <= killed_at < 4
    resumed = subprocess.run([*command, "--resume", str(run)], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [e["step"] for e in read_events(run, "step")]
    assert steps == [1, 2, 3, 4]
    trained = Counter(e["step"] for e in read_events(run, "trajectory") if e["stage"] == "grpo")
    assert trained == {1: 2, 2: 2, 3: 2, 4: 2}  # every step trained on one group of 2, none twice
    check_grpo_accounting(run, steps=4)
    assert [e["event"] for e in read_events(run, "run")] == ["start", "resume", "end"]
    assert "base" in resumed.stdout and "grpo" in resumed.stdout  # the table covers every stage
    assert json.loads((run / "state.json").read_text())["grpo_step"] == 4
