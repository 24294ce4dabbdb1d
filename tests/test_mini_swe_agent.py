"""The real mini-swe-agent (extra `agents`) drives GRPO rollouts through the recording endpoint."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from patchgym.core.metrics import read_events
from patchgym.plugins.mini_swe_agent import VERSION
from tests.pipeline_support import run_config

pytestmark = pytest.mark.usefixtures("train_extra")
pytest.importorskip("minisweagent", reason="needs pip install 'patchgym[agents]'")

SCAFFOLD = {
    "scaffold": "mini-swe-agent",
    # mini-swe-agent's own tool-calling config (`mini`), with prompts short enough for the tiny model's context
    "scaffold_options": {"agent": {"system_template": "Fix the issue.", "instance_template": "{{task}}"}},
    "max_new_tokens_per_turn": 16,
    "max_tokens_per_trajectory": 1024,
}


def test_the_pinned_release_is_installed_and_imports() -> None:
    from minisweagent.agents.default import DefaultAgent  # noqa: F401
    from minisweagent.models.litellm_model import LitellmModel  # noqa: F401

    assert importlib.metadata.version("mini-swe-agent") == VERSION
    pinned = [line for line in Path("pyproject.toml").read_text().splitlines() if line.startswith("agents = ")]
    assert pinned == [f'agents = ["mini-swe-agent=={VERSION}"]']


def test_mini_swe_agent_grpo_run_trains_on_exact_tokens(tmp_path: Path) -> None:
    from patchgym.cli import app

    changes = {"sft": {"enabled": False}, "agent": SCAFFOLD, "env": {"max_turns": 3}}
    config = run_config(tmp_path, steps=1, sft=False, changes=changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    [step] = read_events(run, "step")
    # The tokens trained on are the engine's own, with its log-probs: the first batch was sampled with the
    # weights being trained, so the trainer's log-probs match the engine's (the built-in agent's bound).
    assert step["trainer"]["logprob_gap"] < 1e-4
    episodes = [e for e in read_events(run, "trajectory") if e["stage"] == "grpo"]
    assert len(episodes) == 2 and all(e["infra_error"] is None for e in episodes)
    for episode in episodes:
        recording = episode["recording"]
        assert recording["calls"] >= 1 and episode["generated_tokens"] > 0
        # mini-swe-agent leaves a malformed reply out of its history: each one splits the episode
        assert recording["samples"] == recording["prefix_mismatches"] + 1
        assert recording["template_mismatches"] == 0 and recording["sampling_overridden"] == 0
    evals = {e["stage"]: e for e in read_events(run, "eval")}
    assert set(evals) == {"base", "grpo"} and evals["grpo"]["infra_errors"] == 0
    launch = read_events(run, "launch")[0]
    assert launch["endpoint"]["base_url"].startswith("http://127.0.0.1:")
