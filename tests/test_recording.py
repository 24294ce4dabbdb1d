"""The recording endpoint: calls joined into exact-token samples, history edits split, malformed tool calls,
keys per episode, caps, and scaffolds that never call it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from patchgym.backends.inference.recording_endpoint import RecordingEndpoint
from patchgym.core.inference import Generation, SamplingParams
from patchgym.core.tools import tool_schemas
from patchgym.envs.recording import EpisodeRecorder, RecordingLimits
from patchgym.envs.scaffold import ScaffoldEpisode, run_scaffold
from patchgym.envs.swe import AsyncSWEEnv
from patchgym.pipeline.run import to_samples

LIMITS = RecordingLimits(max_new_tokens_per_turn=64, max_tokens_per_trajectory=4096, temperature=1.0, top_p=1.0)
TOOLS = tool_schemas(["bash"])
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tests.conftest import require_train_extra

    require_train_extra()
    from patchgym.models.tiny import train_tokenizer

    return train_tokenizer()


class Scripted:
    """An engine that says the given texts in order, recording the prompts it was given."""

    max_context = 8192

    def __init__(self, tokenizer: Any, texts: Sequence[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(input_ids))
        tokens = [*self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False), self.end]
        return Generation(tokens, [-0.25] * len(tokens), "stop", 5)


def opening() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "The bug is in calc.py."}]


async def test_calls_join_into_one_exact_token_sample(tokenizer: Any) -> None:
    engine = Scripted(tokenizer, [f"Look.\n{CALL}", "Done."])
    recorder = EpisodeRecorder(engine, tokenizer, LIMITS)
    first = await recorder.complete({"messages": opening(), "tools": TOOLS, "temperature": 0.3})
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Look."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
    history = [*opening(), choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "calc.py"}]
    second = await recorder.complete({"messages": history, "tools": TOOLS})
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "Done."}
    [chat] = recorder.chats
    assert engine.prompts[1] == chat.token_ids[: len(engine.prompts[1])]  # the second prompt extends the first turn
    rendered = tokenizer.apply_chat_template([*history, second["choices"][0]["message"]], tools=TOOLS, tokenize=False)
    assert tokenizer.decode(chat.token_ids) + "\n" == rendered
    sampled = [t for t, m in zip(chat.token_ids, chat.loss_mask, strict=True) if m]
    assert tokenizer.decode(sampled) == f"Look.\n{CALL}<|im_end|>Done.<|im_end|>"
    assert all(lp == -0.25 for lp, m in zip(chat.logprobs, chat.loss_mask, strict=True) if m)
    assert recorder.stats() == {
        "calls": 2,
        "samples": 1,
        "prefix_mismatches": 0,
        "template_mismatches": 0,
        "malformed_tool_calls": 0,
        "sampling_overridden": 1,  # the request's temperature 0.3 was not used: the run's 1.0 was
    }


async def test_a_scaffold_that_edits_history_splits_the_episode(tokenizer: Any) -> None:
    engine = Scripted(tokenizer, [CALL, "second", "third"])
    recorder = EpisodeRecorder(engine, tokenizer, LIMITS)
    reply = (await recorder.complete({"messages": opening(), "tools": TOOLS}))["choices"][0]["message"]
    tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "x" * 50}
    await recorder.complete({"messages": [*opening(), reply, tool], "tools": TOOLS})
    # The scaffold shortens an old observation (as history compaction does): no longer an extension.
    edited = [*opening(), reply, {**tool, "content": "[output elided]"}, {"role": "user", "content": "go on"}]
    await recorder.complete({"messages": edited, "tools": TOOLS})
    assert recorder.prefix_mismatches == 1 and len(recorder.chats) == 2
    first, second = recorder.chats
    assert sum(first.loss_mask) > 0 and len(first.turns) == 2 and len(second.turns) == 1
    assert "[output elided]" in tokenizer.decode(second.token_ids) and "x" * 50 not in tokenizer.decode(
        second.token_ids
    )
    # Earlier turns in the new sample's prompt are not trained on: only what was sampled for it is.
    assert tokenizer.decode([t for t, m in zip(second.token_ids, second.loss_mask, strict=True) if m]) == (
        "third<|im_end|>"
    )


async def test_malformed_tool_calls_come_back_as_text(tokenizer: Any) -> None:
    engine = Scripted(tokenizer, ['<tool_call>{"name": "bash", "arguments": {"command": </tool_call>'])
    recorder = EpisodeRecorder(engine, tokenizer, LIMITS)
    body = await recorder.complete({"messages": opening(), "tools": TOOLS})
    message = body["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"].startswith("<tool_call>")
    assert body["choices"][0]["finish_reason"] == "stop" and recorder.malformed_tool_calls == 1
    assert sum(recorder.chats[0].loss_mask) > 0  # the malformed turn is recorded and trained on like any other


@pytest.fixture
async def endpoint(tokenizer: Any) -> AsyncIterator[RecordingEndpoint]:
    engine = Scripted(tokenizer, [CALL] * 8)
    endpoint = await RecordingEndpoint(engine, tokenizer, RecordingLimits(64, 400, 1.0, 1.0)).start()
    yield endpoint
    await endpoint.aclose()


async def test_each_episode_has_its_own_key_on_localhost(endpoint: RecordingEndpoint) -> None:
    assert endpoint.base_url.startswith("http://127.0.0.1:")
    key, recorder = endpoint.open()
    other_key, other = endpoint.open()
    request = {"model": "patchgym-policy", "messages": opening(), "tools": TOOLS}
    async with httpx.AsyncClient(base_url=endpoint.base_url, timeout=120) as client:
        answer = await client.post("/chat/completions", json=request, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["tool_calls"]
        assert recorder.calls == 1 and other.calls == 0
        refused = await client.post("/chat/completions", json=request, headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 401 and "every episode has its own key" in refused.json()["error"]["message"]
        # The token budget (400) is spent by the second call's prompt: OpenAI's context-length error.
        history = [*opening(), answer.json()["choices"][0]["message"], {"role": "tool", "content": "y " * 400}]
        over = await client.post(
            "/chat/completions", json={**request, "messages": history}, headers={"Authorization": f"Bearer {key}"}
        )
        assert over.status_code == 400 and "maximum context length" in over.json()["error"]["message"]
        assert recorder.cap == "max_total_tokens"
        endpoint.close(other_key)
        closed = await client.post("/chat/completions", json=request, headers={"Authorization": f"Bearer {other_key}"})
        assert closed.status_code == 401


class Silent:
    """A scaffold that runs a command but never asks the model (misconfigured: not pointed at the endpoint)."""

    async def run(self, episode: ScaffoldEpisode) -> None:
        await episode.execute("ls")


class Editor:
    """A scaffold that calls the endpoint twice, rewriting its first message before the second call."""

    async def run(self, episode: ScaffoldEpisode) -> None:
        headers = {"Authorization": f"Bearer {episode.api_key}"}
        messages = [{"role": "user", "content": episode.prompt}]
        async with httpx.AsyncClient(base_url=episode.base_url, timeout=120) as client:
            first = await client.post("/chat/completions", json={"messages": messages, "tools": TOOLS}, headers=headers)
            reply = first.json()["choices"][0]["message"]
            command = json.loads(reply["tool_calls"][0]["function"]["arguments"])["command"]
            result = await episode.execute(command)
            messages = [{"role": "user", "content": "(summary) " + episode.prompt}, reply]
            messages.append({"role": "tool", "content": result["output"]})
            await client.post("/chat/completions", json={"messages": messages, "tools": TOOLS}, headers=headers)
        await episode.execute("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[AsyncSWEEnv]:
    environment = AsyncSWEEnv("easy", "local", task_set_options={"count": 2, "cache_dir": str(tmp_path)}, max_turns=4)
    yield environment
    await environment.close()


async def test_a_scaffold_that_never_calls_the_endpoint_is_an_infra_error(
    endpoint: RecordingEndpoint, env: AsyncSWEEnv
) -> None:
    key, recorder = endpoint.open()
    trajectory = await run_scaffold(env, Silent(), recorder, endpoint.base_url, key, "easy-train-0000")
    assert trajectory.infra_error is not None and trajectory.infra_error["kind"] == "scaffold"
    assert "made no model call through the recording endpoint" in trajectory.infra_error["message"]
    assert not trajectory.trainable and trajectory.reward is None and trajectory.token_ids == []


async def test_a_split_scaffold_episode_trains_every_segment(endpoint: RecordingEndpoint, env: AsyncSWEEnv) -> None:
    key, recorder = endpoint.open(RecordingLimits(64, 4096, 1.0, 1.0))
    trajectory = await run_scaffold(env, Editor(), recorder, endpoint.base_url, key, "easy-train-0000")
    assert trajectory.termination == "submitted" and trajectory.trainable and trajectory.reward == 0.0
    assert trajectory.recording is not None and trajectory.recording["prefix_mismatches"] == 1
    samples = to_samples(trajectory, advantage=0.5)
    assert len(samples) == 2 and all(s.advantage == 0.5 and sum(s.loss_mask) > 0 for s in samples)
    assert [t.kind for t in trajectory.turns] == ["command", "submit"]
    assert all(len(s.engine_logprobs or []) == len(s.token_ids) for s in samples)
