"""The embedded engine: correct log-probs, batching that changes nothing, every limit honoured."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_train_extra

require_train_extra()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from patchgym.backends.inference.embedded import EmbeddedEngine  # noqa: E402
from patchgym.core.errors import ConfigError, EngineError  # noqa: E402
from patchgym.core.inference import InferenceEngine, SamplingParams  # noqa: E402
from patchgym.core.plugins import registry  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)
PROMPTS = [[1, 40 + i, 7, 300 + 3 * i] + list(range(100, 100 + 2 * i)) for i in range(12)]


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    engine = EmbeddedEngine(tiny_model_dir, max_context=256, max_batch_size=8, stop_at_eos=False)
    yield engine
    await engine.aclose()


def forward_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """Teacher-forced log-probs of `tokens` after `prompt`, in one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]


async def test_sampled_logprobs_match_a_teacher_forced_forward_pass(
    engine: EmbeddedEngine, tiny_model_dir: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7)
    generations = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert len(generation.token_ids) == len(generation.logprobs) == 40
        reference = forward_logprobs(model, prompt, list(generation.token_ids))
        assert max(abs(a - b) for a, b in zip(reference, generation.logprobs, strict=True)) < 1e-4
    scaled = await engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=20, temperature=0.7, seed=1))
    reference = forward_logprobs(model, PROMPTS[3], list(scaled.token_ids), temperature=0.7)
    assert max(abs(a - b) for a, b in zip(reference, scaled.logprobs, strict=True)) < 1e-4


async def test_batched_greedy_equals_unbatched(engine: EmbeddedEngine) -> None:
    alone = [await engine.generate(prompt, GREEDY) for prompt in PROMPTS]
    together = await asyncio.gather(*(engine.generate(prompt, GREEDY) for prompt in PROMPTS))  # > max_batch_size
    for a, b in zip(alone, together, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


async def test_a_request_joins_a_running_batch_at_the_next_step(engine: EmbeddedEngine) -> None:
    long = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=200, temperature=0)))
    while engine._steps < 5:
        await asyncio.sleep(0.001)
    short = await engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=3, temperature=0))
    assert not long.done(), "the short request waited for the running batch to finish"
    assert len(short.token_ids) == 3
    finished = await long
    assert len(finished.token_ids) == 200 and finished.finish_reason == "length"
    assert list(short.token_ids) == list((await engine.generate(PROMPTS[1], short_params(3))).token_ids)


def short_params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


async def test_stop_tokens_length_and_context_cap(engine: EmbeddedEngine) -> None:
    free = await engine.generate(PROMPTS[2], GREEDY)
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop = free.token_ids[5]
    first = list(free.token_ids).index(stop)
    stopped = await engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == list(free.token_ids[: first + 1])

    prompt = list(range(10, 250))
    capped = await engine.generate(prompt, SamplingParams(max_new_tokens=100, temperature=0))
    assert capped.finish_reason == "context" and len(prompt) + len(capped.token_ids) == engine.max_context
    too_long = await engine.generate(list(range(10, 10 + engine.max_context)), GREEDY)
    assert too_long.finish_reason == "context" and list(too_long.token_ids) == []


async def test_seeds_and_top_p(engine: EmbeddedEngine) -> None:
    seeded = SamplingParams(max_new_tokens=30, temperature=1.0, seed=11)
    a, b = await asyncio.gather(engine.generate(PROMPTS[4], seeded), engine.generate(PROMPTS[4], seeded))
    assert list(a.token_ids) == list(b.token_ids)
    other = await engine.generate(PROMPTS[4], SamplingParams(max_new_tokens=30, temperature=1.0, seed=12))
    assert list(other.token_ids) != list(a.token_ids)
    nucleus = await engine.generate(PROMPTS[4], SamplingParams(max_new_tokens=30, temperature=1.0, top_p=1e-6, seed=5))
    greedy = await engine.generate(PROMPTS[4], SamplingParams(max_new_tokens=30, temperature=0))
    assert list(nucleus.token_ids) == list(greedy.token_ids)


async def test_update_weights_from_state_dict_and_folder(
    engine: EmbeddedEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from patchgym.models.tiny import init_tiny_model

    before = await engine.generate(PROMPTS[5], GREEDY)
    assert before.weight_version == 0
    other = AutoModelForCausalLM.from_pretrained(init_tiny_model(tmp_path / "other", seed=1)).eval()
    await engine.pause()
    await engine.update_weights(other.state_dict(), version=1)
    await engine.resume()
    after = await engine.generate(PROMPTS[5], GREEDY)
    assert after.weight_version == 1
    assert list(after.token_ids) != list(before.token_ids)
    reference = forward_logprobs(other, PROMPTS[5], list(after.token_ids))
    assert max(abs(a - b) for a, b in zip(reference, after.logprobs, strict=True)) < 1e-4

    await engine.update_weights(str(tiny_model_dir), version=2)
    back = await engine.generate(PROMPTS[5], GREEDY)
    assert back.weight_version == 2 and list(back.token_ids) == list(before.token_ids)

    with pytest.raises(ConfigError, match="unexpected"):
        await engine.update_weights({"not.a.weight": torch.zeros(1)}, version=3)
    with pytest.raises(ConfigError, match="safetensors"):
        await engine.update_weights(tmp_path, version=3)
    assert engine.weight_version == 2


async def test_pause_holds_requests_until_resume(engine: EmbeddedEngine) -> None:
    running = asyncio.create_task(engine.generate(PROMPTS[6], SamplingParams(max_new_tokens=150, temperature=0)))
    while engine._steps < 3:
        await asyncio.sleep(0.001)
    await engine.pause()
    steps = engine._steps
    queued = asyncio.create_task(engine.generate(PROMPTS[7], GREEDY))
    await asyncio.sleep(0.3)
    assert engine._steps == steps and not running.done() and not queued.done()
    await engine.resume()
    assert len((await running).token_ids) == 150 and len((await queued).token_ids) == 24


async def test_cancel_and_close_abort_requests(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_context=1024, stop_at_eos=False)
    cancelled = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=900, temperature=0)))
    while engine._steps < 2:
        await asyncio.sleep(0.001)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert (await engine.generate(PROMPTS[1], GREEDY)).finish_reason == "length"

    in_flight = asyncio.create_task(engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=900, temperature=0)))
    while engine._steps < 30:
        await asyncio.sleep(0.001)
    await engine.aclose()
    aborted = await in_flight
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 900
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(PROMPTS[1], GREEDY)


async def test_bad_requests_are_clear_errors(engine: EmbeddedEngine) -> None:
    with pytest.raises(ConfigError, match="empty"):
        await engine.generate([], GREEDY)
    with pytest.raises(ConfigError, match="vocabulary"):
        await engine.generate([1, 10**6], GREEDY)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        await engine.generate([1], SamplingParams(max_new_tokens=0))
    with pytest.raises(ConfigError, match="top_p"):
        await engine.generate([1], SamplingParams(max_new_tokens=1, top_p=0))
    with pytest.raises(ConfigError, match="weights must be"):
        await engine.update_weights(42, version=1)


async def test_registered_as_inference_backend(tiny_model_dir: Path) -> None:
    engine = registry().create(
        "inference", "embedded", model=str(tiny_model_dir), max_context=128, max_batch_size=4, stop_at_eos=False
    )
    try:
        assert isinstance(engine, InferenceEngine)
        assert engine.settings()["max_context"] == 128 and engine.settings()["max_batch_size"] == 4
        assert (await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))).finish_reason == "length"
    finally:
        await engine.aclose()
    default = EmbeddedEngine(tiny_model_dir, max_context=128)
    assert default.settings()["stop_at_eos_ids"] == [0, 2]  # <|endoftext|>, <|im_end|> from generation_config
    await default.aclose()
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        EmbeddedEngine(tiny_model_dir, max_context=10**6)
    with pytest.raises(ConfigError, match="config.json"):
        EmbeddedEngine(tiny_model_dir / "nope")


async def test_the_event_loop_keeps_running_while_the_model_works(engine: EmbeddedEngine) -> None:
    gaps: list[float] = []
    loop = asyncio.get_running_loop()

    async def ticker() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    params = SamplingParams(max_new_tokens=200, temperature=0)
    started = loop.time()
    await asyncio.gather(*(engine.generate(prompt, params) for prompt in PROMPTS[:8]))
    took = loop.time() - started
    ticking.cancel()
    # The model never holds the loop: no pause is more than a small part of the whole (a step is
    # milliseconds; measured against the run's own length, so a slow machine slows both alike).
    assert len(gaps) > 10 and max(gaps) < took / 4, (max(gaps), took)


async def test_eos_stops_by_default(tiny_model_dir: Path, engine: EmbeddedEngine) -> None:
    """By default a request ends at the model's EOS (generation_config), like SGLang and `generate`."""
    free = await engine.generate(PROMPTS[2], GREEDY)
    eos = free.token_ids[6]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.eos_token_id = [eos]
    stopping = EmbeddedEngine(model, max_context=256)
    try:
        stopped = await stopping.generate(PROMPTS[2], GREEDY)
    finally:
        await stopping.aclose()
    first = list(free.token_ids).index(eos)
    assert stopped.finish_reason == "stop" and list(stopped.token_ids) == list(free.token_ids[: first + 1])
