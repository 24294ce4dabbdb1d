"""SFT trace files: the upstream formats, tokens identical to the agent loop's, clear errors, a pipeline run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchgym.core.config import validate
from patchgym.core.errors import ConfigError
from patchgym.core.inference import Generation, SamplingParams
from patchgym.core.validation import oracle_command
from patchgym.envs.agent import run_agent
from patchgym.envs.swe import AsyncSWEEnv
from patchgym.pipeline.config import SFTConfig
from patchgym.pipeline.traces import (
    TraceError,
    TraceTally,
    fit,
    load_samples,
    normalise_messages,
    read_traces,
    trace_sample,
)

SUBMIT = "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tests.conftest import require_train_extra

    require_train_extra()
    from patchgym.models.tiny import train_tokenizer

    return train_tokenizer()


def conversation(task: int = 0) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You fix bugs with bash."},
        {"role": "user", "content": f"Fix issue {task} in the repo."},
        {"role": "assistant", "content": f"Look first.\n```bash\ncat file_{task}.py\n```"},
        {"role": "user", "content": f"exit code 0\ndef f(): return {task}"},
        {"role": "assistant", "content": f"```bash\nsed -i s/{task}/{task + 1}/ file_{task}.py\n```"},
        {"role": "user", "content": "exit code 0"},
        {"role": "assistant", "content": SUBMIT},
    ]


def mini_swe_agent(messages: list[dict[str, Any]], exit_status: str = "Submitted", v2: bool = True) -> dict[str, Any]:
    """A trajectory as mini-swe-agent writes it: save_traj (v1), or Agent.save (v2: `extra`, the exit message)."""
    info = {
        "exit_status": exit_status,
        "submission": "diff --git a/f.py b/f.py\n",
        "model_stats": {"instance_cost": 0.01, "api_calls": 3},
        "mini_version": "2.0.0" if v2 else "1.17.3",
        "config": {"agent": {"step_limit": 0}, "agent_type": "minisweagent.agents.default.DefaultAgent"},
    }
    if not v2:
        return {"info": info, "messages": messages, "trajectory_format": "mini-swe-agent-1"}
    extra = [{**m, "extra": {"timestamp": 1.0}} for m in messages]
    closing = {"role": "exit", "content": info["submission"], "extra": {"exit_status": exit_status}}
    return {"info": info, "messages": [*extra, closing], "trajectory_format": "mini-swe-agent-1.1"}


def openai_variant(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The same chat with text parts and `tool` observations, as OpenAI-style exports hold it."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] == "user" and i > 1:
            out.append({"role": "tool", "content": m["content"], "tool_call_id": f"call_{i}"})
        elif m["role"] == "assistant":
            out.append({"role": "assistant", "content": [{"type": "text", "text": m["content"]}]})
        else:
            out.append(dict(m))
    return out


def write_jsonl(path: Path, records: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def one_sample(tokenizer: Any, path: Path, fmt: str = "auto") -> Any:
    tally = TraceTally()
    samples = list(load_samples(read_traces(path, fmt), tokenizer, 1 << 20, "skip", tally))  # type: ignore[arg-type]
    assert len(samples) == 1, tally.as_dict()
    return samples[0]


# -- identical to the agent loop --------------------------------------------------------------
class Script:
    """A policy that says the given assistant messages in order, as an engine would return them."""

    max_context = 4096

    def __init__(self, tokenizer: Any, messages: Sequence[str]) -> None:
        self.tokenizer, self.messages = tokenizer, list(messages)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        tokens = [*self.tokenizer.encode(self.messages.pop(0), add_special_tokens=False), self.end]
        return Generation(tokens, [0.0] * len(tokens), "stop", 0)


async def test_every_format_tokenises_exactly_like_the_agent_loop(tmp_path: Path, tokenizer: Any) -> None:
    env = AsyncSWEEnv("easy", "local", task_set_options={"count": 2, "cache_dir": str(tmp_path / "tasks")})
    prompt: list[dict[str, str]] = []
    reset = env.reset

    async def recording_reset(**kwargs: Any) -> Any:
        observation, info = await reset(**kwargs)
        prompt.extend(info["messages"])
        return observation, info

    env.reset = recording_reset  # type: ignore[method-assign]
    task = env.task_set.get("easy-train-0000")
    script = ["Look around.\n```bash\nls\n```", f"```bash\n{oracle_command(task)}\n```", SUBMIT]
    try:
        trajectory = await run_agent(env, Script(tokenizer, script), tokenizer, task.id)
    finally:
        await env.close()
    assert trajectory.reward == 1.0 and len(trajectory.turns) == 3
    chat = list(prompt)
    for turn in trajectory.turns:
        chat += [{"role": "assistant", "content": turn.action}, {"role": "user", "content": turn.observation}]
    chat = chat[:-1]  # the episode ends with the submitting turn

    files = {
        "mini-swe-agent": tmp_path / "run" / task.id / f"{task.id}.traj.json",
        "mini-swe-agent-v1": tmp_path / "v1.traj.json",
        "openai": tmp_path / "chat.json",
        "swe-smith": tmp_path / "ft.jsonl",
    }
    files["mini-swe-agent"].parent.mkdir(parents=True)
    files["mini-swe-agent"].write_text(json.dumps(mini_swe_agent(chat)))
    files["mini-swe-agent-v1"].write_text(json.dumps(mini_swe_agent(chat, v2=False)))
    files["openai"].write_text(json.dumps(openai_variant(chat)))
    write_jsonl(files["swe-smith"], [{"messages": chat, "instance_id": task.id, "resolved": True, "model": "m"}])
    for name, path in files.items():
        for fmt in ("auto", name.removesuffix("-v1")):
            sample = one_sample(tokenizer, path, fmt)
            assert sample.token_ids == trajectory.token_ids, (name, fmt)
            assert sample.loss_mask == trajectory.loss_mask, (name, fmt)
    assert one_sample(tokenizer, tmp_path / "run").token_ids == trajectory.token_ids  # a run directory


def test_loss_is_on_assistant_tokens_only(tokenizer: Any) -> None:
    messages = conversation()
    sample = trace_sample(tokenizer, messages, "x")
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = []
    for m in messages:
        if m["role"] == "assistant":
            expected += [*tokenizer.encode(m["content"], add_special_tokens=False), end]
    assert trained == expected
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(sample.token_ids) == rendered.removesuffix("\n")  # the rollout ends at the turn end


# -- formats, roles and filters ---------------------------------------------------------------
def test_roles_parts_and_reasoning_are_normalised() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "answer", "reasoning_content": "\nthink hard\n"},
        {"role": "function", "name": "bash", "content": None},
        {"role": "exit", "content": "patch", "extra": {"exit_status": "Submitted"}},
    ]
    assert normalise_messages(messages, "f") == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "<think>\nthink hard\n</think>\n\nanswer"},
        {"role": "user", "content": ""},
    ]


def test_filters_skip_unfinished_and_unresolved_traces_with_reasons(tmp_path: Path, tokenizer: Any) -> None:
    runs = tmp_path / "runs"
    for i, status in enumerate(["Submitted", "LimitsExceeded", "Submitted"]):
        (runs / f"t{i}").mkdir(parents=True)
        (runs / f"t{i}" / f"t{i}.traj.json").write_text(json.dumps(mini_swe_agent(conversation(i), status)))
    (runs / "preds.json").write_text(json.dumps({"t0": {"model_patch": "diff"}}))  # not a trace: ignored
    unfinished = mini_swe_agent(conversation(3))
    del unfinished["info"]["exit_status"]  # v2 still says it in the closing exit message
    unfinished["messages"][-1]["extra"]["exit_status"] = "FormatError"
    (runs / "t3").mkdir()
    (runs / "t3" / "t3.traj.json").write_text(json.dumps(unfinished))
    tally = TraceTally()
    samples = list(load_samples(read_traces(runs), tokenizer, 4096, "skip", tally))
    assert len(samples) == 2 and tally.made == 4
    assert tally.skipped == {"exit_status LimitsExceeded": 1, "exit_status FormatError": 1}
    assert tally.examples["exit_status LimitsExceeded"] == [str(runs / "t1" / "t1.traj.json")]
    everything = list(read_traces(runs, exit_statuses=None))
    assert [t.skip for t in everything] == [None] * 4

    lines = [{"messages": conversation(i), "instance_id": f"i{i}", "resolved": i != 1} for i in range(3)]
    lines[2]["messages"] = json.dumps(lines[2]["messages"])  # some exports hold the list as JSON text
    path = write_jsonl(tmp_path / "ft.jsonl", lines)
    traces = list(read_traces(path, "swe-smith"))
    assert [t.skip for t in traces] == [None, "not resolved", None]
    assert traces[1].where == f"{path}:2" and traces[2].messages == conversation(2)
    assert [t.skip for t in read_traces(path, resolved_only=False)] == [None, None, None]


def test_a_json_array_of_records_and_bare_lists(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([{"messages": conversation(0), "info": {"source": "chat"}}, conversation(1)]))
    for fmt in ("openai", "auto"):  # an "info" object without an exit_status is not a mini-swe-agent one
        traces = list(read_traces(path, fmt))  # type: ignore[arg-type]
        assert [t.where for t in traces] == [f"{path}[0]", f"{path}[1]"] and traces[0].skip is None
        assert traces[1].messages == conversation(1)


def test_too_long_traces_are_skipped_or_truncated(tokenizer: Any) -> None:
    sample = trace_sample(tokenizer, conversation(), "x")
    first = sample.loss_mask.index(1)
    assert fit(sample, len(sample), "skip") == (sample, "")
    assert fit(sample, first + 3, "skip") == (None, f"longer than {first + 3} tokens")
    cut, _ = fit(sample, first + 3, "truncate")
    assert cut is not None and cut.token_ids == sample.token_ids[: first + 3] and sum(cut.loss_mask) == 3
    assert fit(sample, first, "truncate") == (None, f"no assistant token in the first {first} tokens")
    tally = TraceTally()
    assert tally.admit("x", sample, "", first + 3, "truncate") is not None
    assert tally.as_dict()["truncated"] == 1 and tally.kept == 1


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "fmt", "expected"),
    [
        ("{not json", "auto", ":2: not valid JSON"),
        (json.dumps({"prompt": "x"}), "auto", ':2: expected an object with "messages"'),
        (json.dumps({"messages": conversation()}), "mini-swe-agent", ':2: a mini-swe-agent trajectory has an "info"'),
        (json.dumps([{"role": "robot", "content": "x"}]), "openai", ":2: message 0 has role 'robot'"),
        (json.dumps([{"content": "x"}]), "openai", ':2: message 0 is not an object with a "role"'),
        (
            json.dumps([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{}]}]),
            "openai",
            ":2: message 1: a tool call needs",
        ),
        (
            json.dumps([{"role": "user", "content": "x"}, {"role": "assistant", "function_call": {"name": "f"}}]),
            "openai",
            ":2: message 1 makes a legacy function_call",
        ),
        (json.dumps([{"role": "user", "content": [{"type": "image_url"}]}]), "openai", "part of type 'image_url'"),
        (json.dumps({"messages": 3}), "swe-smith", ':2: "messages" must be a list'),
    ],
)
def test_malformed_records_name_the_file_and_line(tmp_path: Path, line: str, fmt: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(mini_swe_agent(conversation())) + "\n" + line + "\n")
    with pytest.raises(TraceError) as caught:
        list(read_traces(path, fmt))  # type: ignore[arg-type]
    assert expected in str(caught.value) and str(path) in str(caught.value)


def test_conversations_that_are_not_rollouts_are_errors(tokenizer: Any) -> None:
    no_answer = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with pytest.raises(TraceError, match="f.jsonl:3: no assistant message"):
        trace_sample(tokenizer, no_answer, "f.jsonl:3")
    with pytest.raises(TraceError, match="starts with an assistant message"):
        trace_sample(tokenizer, conversation()[2:], "f")
    twice = [*conversation()[:3], {"role": "assistant", "content": "again"}]
    with pytest.raises(TraceError, match="two assistant messages in a row"):
        trace_sample(tokenizer, twice, "f")


def test_missing_and_empty_paths_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        list(read_traces(tmp_path / "nope.jsonl"))
    with pytest.raises(TraceError, match=r"no trace files under .*\*\.traj\.json"):
        list(read_traces(tmp_path))


def test_sft_traces_setting() -> None:
    assert [s.format for s in SFTConfig().traces] == ["oracle"]
    config = validate(SFTConfig, {"traces": ["oracle", {"path": "t.jsonl", "format": "swe-smith"}]})
    assert [(s.format, s.path) for s in config.traces] == [("oracle", None), ("swe-smith", "t.jsonl")]
    assert validate(SFTConfig, {"traces": {"path": "d"}}).traces[0].format == "auto"
    problems = {
        "runs/": "'runs/' is not a trace source",
        "{pathz: x}": "traces.0.pathz: unknown key; did you mean 'path'?",
        "{path: x, format: sharegpt}": "traces.0.format: Input should be 'oracle', 'auto'",
        "{format: oracle, path: x}": "takes no path",
        "{format: openai}": "a openai trace source needs a path",
    }
    for value, message in problems.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
            validate(SFTConfig, {"traces": yaml.safe_load(value)})


# -- the pipeline -----------------------------------------------------------------------------
def run_config(tmp_path: Path, traces: list[dict[str, Any]]) -> Path:
    """A short run on a 1-layer tiny model: base evaluation, SFT on `traces`, evaluation; no GRPO."""
    from tests.conftest import require_train_extra
    from tests.pipeline_support import run_config as whole_run

    require_train_extra()
    changes = {
        "model": {"init_tiny": {"num_hidden_layers": 1}},
        "tasks": {"train": {"options": {"count": 2}}, "eval": {"options": {"count": 1}}},
        "inference": {"options": {"max_batch_size": 4}},
        "trainer": {"options": {"lr": 3e-3}},
        "env": {"max_turns": 1},
        "agent": {"max_new_tokens_per_turn": 8},
        "sft": {"batch_size": 1, "lr": None, "traces": traces},
        "grpo": {"enabled": False},
        "eval": {"concurrency": 2},
        "checkpoint_every": 5,
        "metrics": {"tensorboard": False},
    }
    config = whole_run(tmp_path, steps=0, changes=changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_pipeline_sft_trains_on_trace_files_and_its_loss_falls(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from patchgym.cli import app
    from patchgym.core.metrics import read_events

    runs = tmp_path / "mini"
    for i, status in enumerate(["Submitted"] * 3 + ["LimitsExceeded"]):
        (runs / f"t{i}").mkdir(parents=True)
        (runs / f"t{i}" / f"t{i}.traj.json").write_text(json.dumps(mini_swe_agent(conversation(i % 2), status)))
    smith = write_jsonl(
        tmp_path / "smith.jsonl", [{"messages": conversation(i % 2), "resolved": i != 4} for i in range(5)]
    )
    path = run_config(tmp_path, [{"path": str(runs), "format": "mini-swe-agent"}, {"path": str(smith)}])
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    event = read_events(run, "sft_traces")[0]
    assert (event["made"], event["kept"]) == (9, 7)
    assert event["skipped"] == {"exit_status LimitsExceeded": 1, "not resolved": 1}
    assert event["token_cap"] == 1024 and [s["kept"] for s in event["sources"]] == [3, 4]
    losses = [step["loss"] for step in read_events(run, "sft_step")]
    assert len(losses) == 7  # one epoch over the kept traces
    assert losses[-1] < losses[0] - 1.0
    assert json.loads((run / "state.json").read_text())["stages_done"] == ["eval-base", "sft", "eval-sft"]


def test_a_wrong_trace_path_fails_before_the_base_evaluation(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from patchgym.cli import app

    result = CliRunner().invoke(app, ["run", str(run_config(tmp_path, [{"path": str(tmp_path / "nope.jsonl")}]))])
    assert result.exit_code == 2 and "nope.jsonl does not exist" in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()  # found before anything was written
