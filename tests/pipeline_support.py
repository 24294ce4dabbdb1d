"""Shared by the pipeline tests: the run configuration of a tiny run, and the bookkeeping checks
every GRPO run must pass (every group drawn accounted for, no trajectory lost or counted twice,
infrastructure failures never scored and never trained on)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from patchgym.core.batch import Sample
from patchgym.core.metrics import read_events


def merged(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied, nested mappings merged key by key."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def run_config(tmp_path: Path, *, steps: int, sft: bool = True, changes: Mapping[str, Any] = {}) -> dict[str, Any]:
    """A whole run on the tiny model, the easy tasks and local sandboxes (as `patchgym run` reads it)."""
    cache = str(tmp_path / "cache")
    config = {
        "run_dir": str(tmp_path / "run"),
        "seed": 0,
        "tasks": {
            "train": {"name": "easy", "options": {"count": 4, "split": "train", "cache_dir": cache}},
            "eval": {"name": "easy", "options": {"count": 2, "split": "eval", "cache_dir": cache}},
        },
        "sandbox": {"name": "local", "options": {"isolation": "none"}},
        "inference": {"name": "embedded", "options": {"max_context": 1024, "max_batch_size": 8}},
        "trainer": {"name": "embedded", "options": {"lr": 1e-3}},
        "env": {"max_turns": 2, "command_timeout_s": 20},
        "agent": {"max_new_tokens_per_turn": 16, "max_tokens_per_trajectory": 1024},
        "sft": {"enabled": sft, "epochs": 1, "batch_size": 4, "lr": 2e-3},
        "grpo": {
            "steps": steps,
            "lr": 1e-4,
            "rollout": {
                "mode": "fully_async",
                "group_size": 2,
                "batch_groups": 1,
                "concurrency": 4,
                "zero_variance": "keep",
            },
        },
        "eval": {"attempts": 1, "concurrency": 4},
        "checkpoint_every": 1,
        "metrics": {"tensorboard": True},
    }
    return merged(config, changes)


def check_group_accounting(run_dir: str | Path) -> dict[str, Any]:
    """The accounting identity of a run's GRPO stage; returns the final running totals.

    At every step, every group drawn is trained, set aside with a reason, or pending:
    `drawn == trained + sum(discarded) + pending`. The totals change from step to step by exactly
    the groups the step closed (its `groups`, `groups_*` counts and `group_outcomes`), every group
    closes once over the whole run (resumes included), each trajectory logged belongs to a group its
    step closed, and the groups still pending at the end are those the last checkpoint records.
    """
    totals: dict[str, Any] = {"drawn": 0, "trained": 0, "discarded": {}, "pending": 0, "episodes_discarded": 0}
    closed: list[int] = []
    trajectories: dict[int, set[int]] = defaultdict(set)
    for event in read_events(run_dir, "trajectory"):
        if event["stage"] == "grpo":
            trajectories[event["step"]].add(event["group"])
    for step in read_events(run_dir, "step"):
        now = step["accounting"]
        assert now["drawn"] == now["trained"] + sum(now["discarded"].values()) + now["pending"], now
        assert all(n >= 0 for n in (now["pending"], *now["discarded"].values())), now
        outcomes = Counter(outcome for _, _, outcome in step["group_outcomes"])
        assert now["trained"] - totals["trained"] == step["groups"] == outcomes.pop("trained", 0), step
        for reason in {*now["discarded"], *totals["discarded"], *outcomes}:
            change = now["discarded"].get(reason, 0) - totals["discarded"].get(reason, 0)
            assert change == step.get(reason, 0) == outcomes.get(reason, 0), (reason, step)
        assert now["episodes_discarded"] - totals["episodes_discarded"] == step["episodes_discarded"]
        assert trajectories[step["step"]] <= {serial for serial, _, _ in step["group_outcomes"]}
        closed += [serial for serial, _, _ in step["group_outcomes"]]
        totals = now
    assert len(closed) == len(set(closed)), "a group was closed twice"
    state = json.loads((Path(run_dir) / "state.json").read_text())
    if state["rollout"] is not None:
        assert state["rollout"]["drawn"] == totals["drawn"] and len(state["pending"]) == totals["pending"]
    return totals


def drawn_task_ids(run_dir: str | Path) -> Counter[str]:
    """The tasks of every group a run drew, with multiplicity: those it closed and those still pending."""
    closed = [task for step in read_events(run_dir, "step") for _, task, _ in step["group_outcomes"]]
    state = json.loads((Path(run_dir) / "state.json").read_text())
    return Counter([*closed, *state["pending"]])


def check_grpo_accounting(
    run_dir: Path, *, steps: int, trained: Sequence[Sequence[Sample]] | None = None, on_policy: bool = False
) -> dict[int, list[dict[str, Any]]]:
    """Check the GRPO bookkeeping of a finished run; returns its trajectory events by step.

    Every step logs each trajectory it was built from exactly once: the trained ones with a
    reward, every attempt lost to the infrastructure with an `infra_error` kind and no reward,
    and those of groups set aside (stale, too few valid, zero variance) marked `discarded` with
    the reason the step counts. The kinds match the step's `infra_errors_by_kind`, the lost
    attempts are the retried plus the excluded members, and (with `trained`, the trainer's
    batches) the trainer got exactly the scored trajectories of the kept groups. `on_policy`:
    each step's trajectories were sampled by the policy of the step before (sync mode, no SFT).
    """
    steps_logged = read_events(run_dir, "step")
    assert [s["step"] for s in steps_logged] == list(range(1, steps + 1))
    check_group_accounting(run_dir)
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in read_events(run_dir, "trajectory"):
        if event["stage"] == "grpo":
            by_step[event["step"]].append(event)
    assert sorted(by_step) == list(range(1, steps + 1))
    if trained is not None:
        assert len(trained) == steps, "the trainer took a step that was not logged, or missed one"
    for step in steps_logged:
        number, everything = step["step"], by_step[step["step"]]
        reasons = {k for k, v in step.items() if k.startswith("groups_") and v}
        assert {t["discarded"] for t in everything if "discarded" in t} <= reasons
        logged = [t for t in everything if "discarded" not in t]
        lost = [t for t in everything if t["infra_error"]]
        assert all(t["reward"] is None and t["termination"] == "infra_error" for t in lost), "an infra fault scored"
        assert Counter(t["infra_error"]["kind"] for t in lost) == Counter(step["infra_errors_by_kind"])
        assert len(lost) == step.get("infra_retries", 0) + step.get("members_excluded", 0)
        scored = [t for t in logged if not t["infra_error"]]
        assert all(t["reward"] is not None for t in scored)
        assert len(scored) == step["trajectories"]
        if not reasons:  # every started member of a kept group is accounted for
            assert len(scored) == step["groups"] * step["limits"]["group_size"] - step.get("members_excluded", 0)
        if on_policy:
            assert all(t["policy_versions"] == [number - 1] for t in scored), f"step {number} trained off-policy"
        if trained is not None:
            samples = trained[number - 1]
            assert sorted(sum(s.loss_mask) for s in samples) == sorted(t["generated_tokens"] for t in scored)
    return dict(by_step)
