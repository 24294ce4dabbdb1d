"""Native tool calls: the parser, the file tools in a real sandbox, the agent loop's tokens against the
model's chat template, malformed calls as observations, and SFT traces with `tool_calls`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from patchgym.core.chat import ChatTemplateError, TokenChat, assistant_text
from patchgym.core.inference import Generation, SamplingParams
from patchgym.core.tools import ToolCallParser, format_call, tool_schemas
from patchgym.core.validation import oracle_command
from patchgym.envs.agent import run_agent
from patchgym.envs.swe import AsyncSWEEnv, EnvConfig
from patchgym.pipeline.traces import read_traces, trace_sample


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tests.conftest import require_train_extra

    require_train_extra()
    from patchgym.models.tiny import train_tokenizer

    return train_tokenizer()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[AsyncSWEEnv]:
    options = {"count": 4, "cache_dir": str(tmp_path)}
    environment = AsyncSWEEnv("easy", "local", task_set_options=options, max_turns=4, actions="tool_calls")
    yield environment
    await environment.close()


def call(tokenizer: Any, name: str, thought: str = "", **arguments: str) -> str:
    """The text the model writes to call `name` after `thought`, rendered by its chat template."""
    message = {"role": "assistant", "content": thought, "tool_calls": [format_call(name, arguments)]}
    return assistant_text(tokenizer, message)


class Scripted:
    """A policy that says the given assistant messages in order (canonical tokens and the turn end)."""

    max_context = 8192

    def __init__(self, tokenizer: Any, messages: Sequence[str]) -> None:
        self.tokenizer, self.messages = tokenizer, list(messages)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        tokens = [*self.tokenizer.encode(self.messages.pop(0), add_special_tokens=False), self.end]
        return Generation(tokens, [-0.5] * len(tokens), "stop", 3)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("no call at all", "exactly one tool call, but it contained 0"),
        ('<tool_call>{"name": "bash"}</tool_call><tool_call>{"name": "submit"}</tool_call>', "contained 2"),
        ("<tool_call>{not json</tool_call>", "not valid JSON (Expecting property name"),
        ('<tool_call>["bash"]</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm'"),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>', "bash needs the string argument(s)"),
        ('<tool_call>{"name": "bash", "arguments": "{oops"}</tool_call>', "arguments are not valid JSON"),
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "not closed with </tool_call>"),
    ],
)
def test_malformed_calls_are_format_errors_that_say_what_is_wrong(message: str, expected: str) -> None:
    action = ToolCallParser()(message)
    assert action.kind == "format_error" and expected in action.error
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' in action.error


def test_unknown_tools_in_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool"):
        EnvConfig(actions="tool_calls", tools=["bash", "submit", "browse"])
    with pytest.raises(ValueError, match="must include submit"):
        EnvConfig(actions="tool_calls", tools=["bash"])


def test_a_template_without_tools_is_refused(tokenizer: Any) -> None:
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    original = tokenizer.chat_template
    tokenizer.chat_template = plain + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    try:
        with pytest.raises(ChatTemplateError, match="no tool format"):
            TokenChat.start(tokenizer, messages, tools=tool_schemas(["bash", "submit"]))
    finally:
        tokenizer.chat_template = original


async def test_tool_call_episode_solves_the_task_with_tokens_equal_to_the_template(
    env: AsyncSWEEnv, tokenizer: Any
) -> None:
    task = env.task_set.get("easy-train-0001")
    script = [
        call(tokenizer, "view", "Read it first.", path="numbers.py"),
        call(tokenizer, "bash", command=oracle_command(task)),
        call(tokenizer, "submit"),
    ]
    trajectory = await run_agent(env, Scripted(tokenizer, script), tokenizer, task)
    assert trajectory.reward == 1.0 and trajectory.termination == "submitted"
    assert [turn.kind for turn in trajectory.turns] == ["command", "command", "submit"]
    assert "     1\t" in trajectory.turns[0].observation  # the file, with line numbers
    # The appended tokens are exactly the template's rendering of the same chat with the tools.
    _, info = await env.reset(options={"task": task})
    calls = [
        {"role": "assistant", "content": "Read it first.", "tool_calls": [format_call("view", {"path": "numbers.py"})]},
        {"role": "tool", "content": trajectory.turns[0].observation},
        {"role": "assistant", "content": "", "tool_calls": [format_call("bash", {"command": oracle_command(task)})]},
        {"role": "tool", "content": trajectory.turns[1].observation},
        {"role": "assistant", "content": "", "tool_calls": [format_call("submit", {})]},
    ]
    text = tokenizer.apply_chat_template([*info["messages"], *calls], tools=info["tools"], tokenize=False)
    assert tokenizer.decode(trajectory.token_ids) + "\n" == text  # the template closes the last turn with "\n"
    assert '"name": "submit"' in text and "<tool_response>" in text


async def test_file_tools_create_edit_and_report_mistakes(env: AsyncSWEEnv, tokenizer: Any) -> None:
    await env.reset(options={"task": "easy-train-0000"})
    steps = [
        call(tokenizer, "create", path="notes.txt", content="alpha\nbeta 'quoted' $HOME\n"),
        call(tokenizer, "str_replace", path="notes.txt", old_str="beta", new_str="gamma"),
        call(tokenizer, "str_replace", path="notes.txt", old_str="missing", new_str="x"),
    ]
    observations = [(await env.step(step))[0] for step in steps]
    assert "<returncode>0</returncode>" in observations[0] and "wrote notes.txt" in observations[0]
    assert "edited notes.txt" in observations[1]
    assert "<returncode>1</returncode>" in observations[2] and "old_str occurs 0 times" in observations[2]
    assert env.sandbox is not None
    shown = await env.sandbox.exec("cat notes.txt", timeout_s=30)
    assert shown.stdout == "alpha\ngamma 'quoted' $HOME\n"


async def test_a_malformed_call_is_an_observation_and_the_episode_goes_on(env: AsyncSWEEnv, tokenizer: Any) -> None:
    task = env.task_set.get("easy-train-0002")
    script = ['<tool_call>{"name": "bash", "arguments": {"command": }}</tool_call>', call(tokenizer, "submit")]
    trajectory = await run_agent(env, Scripted(tokenizer, script), tokenizer, task)
    assert [turn.kind for turn in trajectory.turns] == ["format_error", "submit"]
    assert "not valid JSON" in trajectory.turns[0].observation
    assert trajectory.termination == "submitted" and trajectory.reward == 0.0
    assert "<tool_response>\nFormat error: the tool call is not valid JSON" in tokenizer.decode(trajectory.token_ids)


def test_sft_traces_with_tool_calls_are_rendered_by_the_template(tmp_path: Path, tokenizer: Any) -> None:
    tools = tool_schemas(["bash", "submit"])
    bash = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    messages = [
        {"role": "system", "content": "Fix it."},
        {"role": "user", "content": "The bug."},
        {"role": "assistant", "content": "Look.", "tool_calls": [bash]},
        {"role": "tool", "tool_call_id": "c1", "content": "calc.py"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "submit"}}]},
    ]
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
    [trace] = list(read_traces(path, "openai"))
    assert trace.tools == tools and trace.messages[3]["role"] == "tool"
    sample = trace_sample(tokenizer, trace.messages, trace.where, trace.tools)
    expected = tokenizer.apply_chat_template(trace.messages, tools=tools, tokenize=False)
    assert tokenizer.decode(sample.token_ids) + "\n" == expected
    trained = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m])
    assert trained == (
        'Look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
        '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>'
    )
