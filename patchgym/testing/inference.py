"""The inference-engine conformance suite: the token-in, token-out contract (patchgym.core.inference).

    from patchgym.testing.inference import InferenceEngineConformance

    class TestMyEngine(InferenceEngineConformance):
        def make_engine(self):
            return MyEngine(model_dir, max_context=256)

Each test gets a fresh engine (closed with `aclose()` afterwards). The tests check that a
generation's tokens and log-probs match up and stay within `max_new_tokens`, that a stop token
ends the turn, that reaching `max_context` ends a turn with "context" instead of raising, that
`update_weights(..., version=v)` tags later generations with v, that `pause()` holds new
generations until `resume()`, and that concurrent calls each get their own answer.
Override `prompt` (token ids valid for your vocabulary) and `weights` (what your
`update_weights` accepts) where the defaults do not fit.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any, get_args

from patchgym.core.inference import FinishReason, Generation, InferenceEngine, SamplingParams
from patchgym.testing._pytest import pytest, pytest_asyncio

__all__ = ["InferenceEngineConformance", "check_generation"]


def check_generation(generation: Generation, prompt_len: int, params: SamplingParams, max_context: int) -> None:
    """Assert that `generation` keeps the contract for a prompt of `prompt_len` tokens under `params`."""
    assert isinstance(generation, Generation), f"generate() returned a {type(generation).__name__}"
    tokens, logprobs = list(generation.token_ids), list(generation.logprobs)
    assert len(tokens) == len(logprobs), f"{len(tokens)} tokens but {len(logprobs)} log-probs"
    assert all(isinstance(t, int) for t in tokens), "token ids must be ints"
    assert all(math.isfinite(lp) and lp <= 1e-4 for lp in logprobs), f"log-probs must be finite and <= 0: {logprobs}"
    assert generation.finish_reason in get_args(FinishReason), f"unknown finish reason {generation.finish_reason!r}"
    assert len(tokens) <= params.max_new_tokens, f"{len(tokens)} tokens for max_new_tokens={params.max_new_tokens}"
    assert prompt_len + len(tokens) <= max_context, "the generation runs past max_context"
    assert isinstance(generation.weight_version, int)
    stops = [i for i, t in enumerate(tokens) if t in params.stop_token_ids]
    assert stops in ([], [len(tokens) - 1]), f"a stop token must end the turn (at {stops} of {len(tokens)})"
    if stops:
        assert generation.finish_reason == "stop"


@pytest.mark.asyncio
class InferenceEngineConformance:
    """Subclass it (with a name starting with `Test`) and implement `make_engine`."""

    def make_engine(self) -> InferenceEngine:
        """A new engine under test."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_engine(self) -> InferenceEngine")

    def prompt(self) -> list[int]:
        """A short prompt of token ids your engine's vocabulary holds."""
        return [1, 2, 3, 4, 5, 6, 7, 8]

    def weights(self, engine: Any) -> Any:
        """What `engine.update_weights` accepts (default None, for engines that ignore it)."""
        return None

    @pytest_asyncio.fixture
    async def engine(self) -> AsyncIterator[Any]:
        engine = self.make_engine()
        try:
            yield engine
        finally:
            await engine.aclose()

    async def _generate(self, engine: Any, prompt: list[int], params: SamplingParams) -> Generation:
        generation = await engine.generate(prompt, params)
        check_generation(generation, len(prompt), params, engine.max_context)
        return generation

    async def test_has_a_context_cap(self, engine: Any) -> None:
        assert isinstance(engine.max_context, int) and engine.max_context > len(self.prompt())

    async def test_generation_keeps_the_contract(self, engine: Any) -> None:
        generation = await self._generate(engine, self.prompt(), SamplingParams(max_new_tokens=16, seed=0))
        assert generation.token_ids, "no token generated for a short prompt"

    async def test_max_new_tokens_is_a_hard_cap(self, engine: Any) -> None:
        generation = await self._generate(engine, self.prompt(), SamplingParams(max_new_tokens=1))
        assert len(generation.token_ids) == 1 and generation.finish_reason in ("length", "stop")

    async def test_stop_token_ends_the_turn(self, engine: Any) -> None:
        first = await self._generate(engine, self.prompt(), SamplingParams(max_new_tokens=4, temperature=0.0))
        stop = first.token_ids[0]  # what greedy decoding says first: make it the stop token
        stopped = await self._generate(
            engine, self.prompt(), SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[stop])
        )
        assert list(stopped.token_ids) == [stop] and stopped.finish_reason == "stop"

    async def test_reaching_max_context_ends_with_context(self, engine: Any) -> None:
        prompt = self.prompt()
        full = (prompt * (engine.max_context // len(prompt) + 1))[: engine.max_context]
        at_cap = await self._generate(engine, full, SamplingParams(max_new_tokens=8))
        assert at_cap.finish_reason == "context" and not at_cap.token_ids
        near = full[:-1]
        one_left = await self._generate(engine, near, SamplingParams(max_new_tokens=8))
        assert len(one_left.token_ids) <= 1 and one_left.finish_reason in ("context", "stop")

    async def test_update_weights_tags_later_generations(self, engine: Any) -> None:
        await engine.pause()
        await engine.update_weights(self.weights(engine), version=7)
        await engine.resume()
        generation = await self._generate(engine, self.prompt(), SamplingParams(max_new_tokens=2))
        assert generation.weight_version == 7

    async def test_pause_holds_new_generations_until_resume(self, engine: Any) -> None:
        await engine.pause()
        pending = asyncio.create_task(engine.generate(self.prompt(), SamplingParams(max_new_tokens=2)))
        try:
            await asyncio.sleep(0.3)  # a window for a wrong engine to finish; a right one never does
            assert not pending.done(), "generate() finished while the engine was paused"
        finally:
            await engine.resume()
        check_generation(await pending, len(self.prompt()), SamplingParams(max_new_tokens=2), engine.max_context)

    async def test_concurrent_generations(self, engine: Any) -> None:
        params = SamplingParams(max_new_tokens=4)
        prompts = [self.prompt()[: 2 + i % 4] for i in range(8)]
        generations = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        for prompt, generation in zip(prompts, generations, strict=True):
            check_generation(generation, len(prompt), params, engine.max_context)
