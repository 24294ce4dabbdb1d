"""The agent loop: tokens, caps and faults, with the real embedded engine and a scripted policy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from patchgym.core.errors import TransportError
from patchgym.core.inference import Generation, SamplingParams
from patchgym.core.validation import oracle_command
from patchgym.envs.agent import AgentConfig, describe, run_agent
from patchgym.envs.swe import AsyncSWEEnv


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[AsyncSWEEnv]:
    environment = AsyncSWEEnv("easy", "local", task_set_options={"count": 4, "cache_dir": str(tmp_path)}, max_turns=3)
    yield environment
    await environment.close()


class ScriptedEngine:
    """A policy that says the given assistant messages in order (tokenised exactly)."""

    max_context = 4096

    def __init__(self, tokenizer: Any, messages: Sequence[str], version: int = 7) -> None:
        self.tokenizer, self.messages, self.version = tokenizer, list(messages), version
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        tokens = [*self.tokenizer.encode(self.messages.pop(0), add_special_tokens=False), self.end]
        return Generation(tokens, [-0.5] * len(tokens), "stop", self.version)


class FailingEngine(ScriptedEngine):
    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        raise TransportError("engine unreachable")


async def test_scripted_oracle_earns_reward_and_records_tokens(env: AsyncSWEEnv, tokenizer: Any) -> None:
    task = env.task_set.get("easy-train-0001")
    script = [
        f"Fix it.\n```bash\n{oracle_command(task)}\n```",
        "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    ]
    trajectory = await run_agent(env, ScriptedEngine(tokenizer, script), tokenizer, "easy-train-0001")
    assert trajectory.reward == 1.0 and trajectory.termination == "submitted"
    assert len(trajectory.turns) == 2
    n = len(trajectory.token_ids)
    assert len(trajectory.loss_mask) == len(trajectory.engine_logprobs) == len(trajectory.policy_versions) == n
    sampled = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert len(sampled) == sum(len(t.token_ids) for t in trajectory.turns)
    assert all(trajectory.engine_logprobs[i] == -0.5 and trajectory.policy_versions[i] == 7 for i in sampled)
    assert all(trajectory.policy_versions[i] == -1 for i in range(n) if not trajectory.loss_mask[i])
    assert tokenizer.decode(trajectory.token_ids[sampled[0] : sampled[0] + 3]).startswith("Fix it")
    record = describe(trajectory)
    assert record["generated_tokens"] == len(sampled) and record["policy_versions"] == [7]


async def test_real_engine_episode_hits_a_cap_and_is_graded(
    env: AsyncSWEEnv, tokenizer: Any, tiny_model_dir: Path
) -> None:
    from patchgym.backends.inference.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_dir, max_context=2048, max_batch_size=4)
    try:
        config = AgentConfig(max_new_tokens_per_turn=24, max_tokens_per_trajectory=1024)
        trajectory = await run_agent(env, engine, tokenizer, "easy-train-0000", config)
    finally:
        await engine.aclose()
    assert trajectory.termination in ("max_turns", "format_errors", "max_total_tokens")
    assert trajectory.reward == 0.0 and trajectory.grade is not None and trajectory.trainable
    sampled = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert 0 < len(sampled) <= 3 * 24
    assert all(trajectory.engine_logprobs[i] < 0 for i in sampled)
    assert trajectory.timings["llm_s"] > 0


async def test_trajectory_token_cap(env: AsyncSWEEnv, tokenizer: Any) -> None:
    script = ["```bash\nls\n```"] * 3
    prompt_tokens = 200  # the system prompt and issue alone exceed the cap below
    config = AgentConfig(max_tokens_per_trajectory=prompt_tokens)
    trajectory = await run_agent(env, ScriptedEngine(tokenizer, script), tokenizer, "easy-train-0002", config)
    assert trajectory.termination == "max_total_tokens" and trajectory.grade is not None


async def test_engine_failure_is_an_infra_error_not_a_zero(env: AsyncSWEEnv, tokenizer: Any) -> None:
    trajectory = await run_agent(env, FailingEngine(tokenizer, []), tokenizer, "easy-train-0003")
    assert trajectory.infra_error is not None and trajectory.infra_error["kind"] == "transport"
    assert trajectory.reward is None and not trajectory.trainable and trajectory.grade is None


class Talker(ScriptedEngine):
    """A policy that always fills its token budget (like a model that never stops), recording its prompts."""

    max_context = 1 << 20

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, [])
        self.filler = tokenizer.encode(" a", add_special_tokens=False)[0]
        self.prompt_lengths: list[int] = []

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.prompt_lengths.append(len(input_ids))
        tokens = [self.filler] * params.max_new_tokens
        return Generation(tokens, [-1.0] * len(tokens), "length", self.version)


async def test_generation_never_runs_past_the_trajectory_cap(env: AsyncSWEEnv, tokenizer: Any) -> None:
    probe = Talker(tokenizer)
    roomy = AgentConfig(max_new_tokens_per_turn=1, max_tokens_per_trajectory=10**6)
    await run_agent(env, probe, tokenizer, "easy-train-0002", roomy)
    prompt = probe.prompt_lengths[0]
    # The turn budget is far above what is left of the trajectory: the room left must bound each turn.
    config = AgentConfig(max_new_tokens_per_turn=4096, max_tokens_per_trajectory=prompt + 40)
    engine = Talker(tokenizer)
    trajectory = await run_agent(env, engine, tokenizer, "easy-train-0002", config)
    assert trajectory.termination == "max_total_tokens" and trajectory.grade is not None
    assert engine.prompt_lengths[0] == prompt
    assert 0 < sum(trajectory.loss_mask) <= 40  # what was left after the prompt
