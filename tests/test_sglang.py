"""The SGLang backend against a real SGLang server (CPU) serving the tiny model.

The server runs from a separate venv (patchgym.backends.inference.sglang_venv: sglang with
--no-deps, its non-CUDA requirements, stub torchvision/sgl_kernel), cached between local runs
and built fresh in CI by .ci/run. Outside CI the tests skip when that venv cannot be built; in
CI that is a failure. Log-probs are checked against a transformers forward pass of the same
weights, before and after each of the three weight-update routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from patchgym.core.inference import Generation, SamplingParams
from patchgym.process_groups import group_members
from tests.conftest import require_train_extra
from tests.processes import ignore_sigint, kill_survivors, run_group, tree_groups
from tests.torchrun_launch import free_port

pytestmark = pytest.mark.timeout(900)  # the first test pays for building the venv and starting the server

MAX_CONTEXT = 512
TOLERANCE = 1e-3
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 20, [7, 300, 9, 120, 4, 66, 810, 3]]
STOP_GRACE_S = 10
STOP_MARGIN_S = 30
"""The launcher gets its stop grace (then SIGKILL) plus this much for its own exit on a loaded machine."""
IDLE_WINDOW_S, IDLE_CPU_SHARE = 5.0, 0.05
"""An idle server uses under this share of one core. Measured at load average 43 on 2 cores: 0.015 with
--sleep-on-idle, 0.14-0.17 without (its scheduler polls; about a whole core on an idle machine)."""


def require_sglang_venv() -> Path:
    """The CPU SGLang venv; skip outside CI when it cannot be built, fail in CI."""
    from patchgym.backends.inference.sglang_venv import build_sglang_venv

    try:
        return build_sglang_venv()
    except Exception as exc:  # any reason the venv cannot exist here
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real-SGLang tests must run in CI, but the SGLang venv failed to build: {exc}")
        pytest.skip(f"cannot build the SGLang venv here ({type(exc).__name__}: {exc})")


@dataclass
class Launched:
    url: str
    groups: set[int]
    """The launcher's process group and the server's."""


@pytest.fixture(scope="module")
def launched(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """A server started by `patchgym engine launch sglang --cpu-venv`, the helper under test:
    it must print the URL once healthy and, on Ctrl-C, stop the server's whole process group
    (scheduler and detokenizer too) within its stop grace and exit 0. The launcher starts with
    SIGINT ignored, as a shell's background job (CI) starts it; whatever is left is killed here."""
    require_sglang_venv()
    port = free_port()
    cli = [sys.executable, "-m", "patchgym.cli", "engine", "launch", "sglang", str(tiny_model_dir), "--cpu-venv"]
    cli += ["--port", str(port), "--context-length", str(MAX_CONTEXT), "--max-total-tokens", "16384"]
    cli += ["--dtype", "float32", "--log-dir", str(tmp_path_factory.mktemp("sglang-logs"))]
    cli += ["--stop-grace", str(STOP_GRACE_S)]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    process = subprocess.Popen(cli, **output, start_new_session=True, preexec_fn=ignore_sigint)
    url = f"http://127.0.0.1:{port}"
    groups = {process.pid}
    try:
        lines: list[str] = []
        while not any(line.startswith("urls=") for line in lines):
            line = process.stdout.readline()  # type: ignore[union-attr]
            assert line, f"the launcher exited before the server was healthy:\n{''.join(lines)}"
            lines.append(line)
        assert lines[-1].strip() == f"urls={url}"
        groups |= tree_groups(process.pid)
        assert len(groups) == 2, "the server runs in a process group of its own"
        yield Launched(url, groups)
        groups |= tree_groups(process.pid)
        process.send_signal(signal.SIGINT)
        assert process.wait(STOP_GRACE_S + STOP_MARGIN_S) == 0
        assert not [pid for group in groups for pid in group_members(group)], "a server process outlived the launcher"
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        kill_survivors(groups)


@pytest.fixture(scope="module")
def sglang_url(launched: Launched) -> str:
    return launched.url


@pytest.fixture
async def engine(sglang_url: str) -> AsyncIterator[Any]:
    from patchgym.backends.inference.sglang import SGLangEngine

    engine = SGLangEngine(sglang_url, max_context=MAX_CONTEXT, concurrency=16)
    yield engine
    await engine.aclose()


@pytest.fixture
async def long_engine(sglang_url: str) -> AsyncIterator[Any]:
    """Ignores EOS, so generations run to max_new_tokens (abort, pause, context-cap tests)."""
    from patchgym.backends.inference.sglang import SGLangEngine

    engine = SGLangEngine(sglang_url, max_context=MAX_CONTEXT, concurrency=16, ignore_eos=True)
    yield engine
    await engine.aclose()


# -- reference: transformers forward pass ----------------------------------------------------
def load_model(directory: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    require_train_extra()
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def reference_logprobs(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """log p(token_i | prompt, tokens_<i) from one teacher-forced forward pass."""
    import torch

    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompt) - 1
    return [logp[start + i, t].item() for i, t in enumerate(tokens)]


def max_error(model: Any, prompt: Sequence[int], generation: Generation) -> float:
    ref = reference_logprobs(model, prompt, generation.token_ids)
    return max(abs(a - b) for a, b in zip(ref, generation.logprobs, strict=True))


def perturbed_weights(model_dir: Path, seed: int) -> dict[str, Any]:
    """The tiny model's weights plus seeded noise: same shapes and tokenizer, different log-probs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    state = load_model(model_dir).state_dict()
    return {name: t + 0.2 * torch.randn(t.shape, generator=generator) for name, t in state.items()}


def model_with(model_dir: Path, weights: Mapping[str, Any], out: Path) -> Any:
    """A transformers model holding `weights`, saved (with the tokenizer) to `out`."""
    model = load_model(model_dir)
    model.load_state_dict(dict(weights))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return model


async def sample_all(engine: Any, max_new_tokens: int = 24) -> list[Generation]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=3)
    return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))


# -- idle ------------------------------------------------------------------------------------------
def cpu_seconds(groups: set[int]) -> float:
    """User + system CPU time of every live process in `groups`."""
    ticks = 0
    for pid in (pid for group in groups for pid in group_members(group)):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            ticks += sum(int(field) for field in stat[stat.rindex(")") + 2 :].split()[11:13])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_does_not_spin(launched: Launched) -> None:
    """With --sleep-on-idle the scheduler blocks on its sockets; without it, it polls and takes a core."""
    started, used = time.monotonic(), cpu_seconds(launched.groups)
    time.sleep(IDLE_WINDOW_S)
    used = cpu_seconds(launched.groups) - used
    assert used < IDLE_CPU_SHARE * (time.monotonic() - started), f"{used:.2f} CPU seconds while idle"


# -- generation --------------------------------------------------------------------------------
async def test_concurrent_generations_match_transformers_logprobs(engine: Any, tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    generations = await sample_all(engine)
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert generation.token_ids, "the engine sampled nothing"
        assert len(generation.logprobs) == len(generation.token_ids)
        assert generation.finish_reason in ("length", "stop")
        assert generation.metrics["prompt_tokens"] == len(prompt)
        assert max_error(model, prompt, generation) < TOLERANCE


async def test_greedy_matches_the_embedded_engine(engine: Any, tiny_model_dir: Path) -> None:
    """Same weights, same prompts, greedy: the same tokens, log-probs within 1e-3."""
    from patchgym.backends.inference.embedded import EmbeddedEngine

    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    embedded = EmbeddedEngine(tiny_model_dir, max_context=MAX_CONTEXT)
    try:
        local = await asyncio.gather(*(embedded.generate(p, params) for p in PROMPTS))
    finally:
        await embedded.aclose()
    remote = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    for ours, theirs in zip(local, remote, strict=True):
        n = min(len(ours.token_ids), len(theirs.token_ids))  # SGLang also stops at the model's EOS
        assert n > 0 and list(ours.token_ids[:n]) == list(theirs.token_ids[:n])
        assert max(abs(a - b) for a, b in zip(ours.logprobs[:n], theirs.logprobs[:n], strict=True)) < TOLERANCE


async def test_stop_token_ends_the_turn(engine: Any) -> None:
    first = await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=16, temperature=0.0))
    stop = first.token_ids[3]
    stopped = await engine.generate(
        PROMPTS[0], SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == list(first.token_ids[: first.token_ids.index(stop) + 1])


async def test_context_cap(long_engine: Any) -> None:
    at_cap = await long_engine.generate([5] * MAX_CONTEXT, SamplingParams(max_new_tokens=8))
    assert (at_cap.finish_reason, list(at_cap.token_ids)) == ("context", [])
    near_cap = await long_engine.generate([5] * (MAX_CONTEXT - 6), SamplingParams(max_new_tokens=50))
    assert near_cap.finish_reason == "context"
    assert len(near_cap.token_ids) == 6
    within = await long_engine.generate([5] * 10, SamplingParams(max_new_tokens=7))
    assert (within.finish_reason, len(within.token_ids)) == ("length", 7)


async def test_abort_reports_abort_not_a_finished_turn(long_engine: Any) -> None:
    params = SamplingParams(max_new_tokens=MAX_CONTEXT - 10)
    task = asyncio.create_task(long_engine.generate([5, 6, 7], params, request_id="abort-me"))
    await asyncio.sleep(0.3)
    assert long_engine.outstanding[long_engine.urls[0]] == 1
    while not task.done():  # repeated: on a loaded machine the request may reach the server late
        await long_engine.abort("abort-me")
        await asyncio.wait({task}, timeout=0.5)
    generation = task.result()
    assert generation.finish_reason == "abort"
    assert len(generation.token_ids) < params.max_new_tokens
    assert long_engine.outstanding[long_engine.urls[0]] == 0


async def test_pause_holds_requests_until_resume(long_engine: Any) -> None:
    params = SamplingParams(max_new_tokens=300)
    task = asyncio.create_task(long_engine.generate([9, 8, 7], params))
    await asyncio.sleep(0.2)
    await long_engine.pause()
    try:
        await asyncio.sleep(1.5)  # a paused engine makes no progress: 300 tokens take < 1.5 s unpaused
        assert not task.done()
    finally:
        await long_engine.resume()
    generation = await asyncio.wait_for(task, 60)
    assert (generation.finish_reason, len(generation.token_ids)) == ("length", 300)


async def test_pause_in_abort_mode_aborts_in_flight(sglang_url: str) -> None:
    from patchgym.backends.inference.sglang import SGLangEngine

    engine = SGLangEngine(sglang_url, max_context=MAX_CONTEXT, pause_mode="abort", ignore_eos=True)
    try:
        task = asyncio.create_task(engine.generate([9, 8, 7], SamplingParams(max_new_tokens=400)))
        await asyncio.sleep(0.3)
        while not task.done():  # a request that arrives while paused waits: resume and pause again
            await engine.pause()
            await asyncio.wait({task}, timeout=2)
            await engine.resume()
        assert task.result().finish_reason == "abort"
    finally:
        await engine.aclose()


async def test_health_flush_and_settings(engine: Any) -> None:
    assert await engine.health() == {engine.urls[0]: True}
    assert await engine.flush_cache() is True
    settings = engine.settings()
    assert settings["concurrency"] == 16 and settings["max_context"] == MAX_CONTEXT
    assert (await engine.model_info())[0]["architectures"] == ["Qwen3ForCausalLM"]


# -- weight updates (each one is checked against transformers with the new weights) ------------
async def check_weights(engine: Any, model: Any, version: int, before: Sequence[Generation]) -> None:
    generations = await sample_all(engine)
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert generation.weight_version == version
        assert max_error(model, prompt, generation) < TOLERANCE
    # the same tokens had clearly different log-probs under the previous weights
    old = before[0]
    assert (
        max(abs(a - b) for a, b in zip(reference_logprobs(model, PROMPTS[0], old.token_ids), old.logprobs, strict=True))
        > 0.05
    )


async def test_update_weights_from_disk(engine: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    before = await sample_all(engine)
    model = model_with(tiny_model_dir, perturbed_weights(tiny_model_dir, seed=1), tmp_path / "v2")
    await engine.update_weights(tmp_path / "v2", version=2)
    await check_weights(engine, model, 2, before)


async def test_update_weights_from_tensors(engine: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    before = await sample_all(engine)
    weights = perturbed_weights(tiny_model_dir, seed=2)
    model = model_with(tiny_model_dir, weights, tmp_path / "v3")
    await engine.update_weights(weights, version=3)
    await check_weights(engine, model, 3, before)


async def test_update_weights_over_a_process_group(engine: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    from patchgym.backends.inference.sglang import DistributedWeights

    before = await sample_all(engine)
    weights = perturbed_weights(tiny_model_dir, seed=3)
    model = model_with(tiny_model_dir, weights, tmp_path / "v4")
    await engine.update_weights(DistributedWeights(weights, master_port=free_port(), timeout_s=60), version=4)
    await check_weights(engine, model, 4, before)


async def test_bucketed_broadcast_of_trainer_weights(
    sglang_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded trainer's weights after a few SFT steps, broadcast as several buckets in one session."""
    from patchgym.backends.inference.sglang import DistributedWeights, SGLangEngine
    from patchgym.backends.trainer.embedded import EmbeddedTrainer
    from patchgym.core.batch import TrainBatch
    from patchgym.core.losses import SFTLoss
    from tests.tiny_models import random_samples

    trainer = EmbeddedTrainer(tiny_model_dir, lr=5e-2)
    batch = TrainBatch(random_samples(8, seed=5, advantages=False))
    for _ in range(3):
        await trainer.train_step(batch, SFTLoss())
    weights = (await trainer.weights()).state_dict
    await trainer.aclose()
    model = model_with(tiny_model_dir, weights, tmp_path / "v5")
    bucket_bytes = sum(t.numel() * t.element_size() for t in weights.values()) // 4
    engine = SGLangEngine(sglang_url, max_context=MAX_CONTEXT, concurrency=16, weight_bucket_bytes=bucket_bytes)
    sent: list[list[str]] = []
    send_bucket = engine._send_bucket

    async def spy(broadcaster: Any, group_name: str, bucket: Mapping[str, Any], version: int | None) -> None:
        sent.append(list(bucket))
        await send_bucket(broadcaster, group_name, bucket, version)

    monkeypatch.setattr(engine, "_send_bucket", spy)
    try:
        before = await sample_all(engine)
        await engine.update_weights(DistributedWeights(weights, master_port=free_port(), timeout_s=60), version=5)
        assert len(sent) >= 4 and [name for bucket in sent for name in bucket] == list(weights)
        await check_weights(engine, model, 5, before)
    finally:
        await engine.aclose()


async def test_megatron_tp2_weights_reach_sglang_by_bucketed_broadcast(
    engine: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real hand-off: Megatron ranks gather TP shards into HF names, rank 0 broadcasts them in buckets."""
    before = await sample_all(engine)
    worker = Path(__file__).with_name("megatron_sglang_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={free_port()}", str(worker), str(tiny_model_dir), engine.urls[0], str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = await asyncio.to_thread(run_group, command, 600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    await check_weights(engine, load_model(tmp_path / "hf"), 6, before)


async def test_refused_weight_update_is_an_error(engine: Any, tmp_path: Path) -> None:
    from patchgym.backends.inference.sglang import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="update_weights_from_disk"):
        await engine.update_weights(tmp_path / "does-not-exist", version=9)
    assert (await engine.generate([5, 6], SamplingParams(max_new_tokens=2))).weight_version != 9


# -- OpenAI-compatible client on the same server ------------------------------------------------
async def test_openai_chat_client_against_sglang(sglang_url: str, tiny_model_dir: Path) -> None:
    """patchgym's OpenAI-compatible client (the eval path) on the same server's /v1 routes."""
    from transformers import AutoTokenizer

    from patchgym.backends.inference.openai import OpenAIChatModel

    messages = [{"role": "user", "content": "fix the bug"}]
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = prompt["input_ids"] if isinstance(prompt, Mapping) else prompt
    client = OpenAIChatModel(sglang_url, max_tokens=8, temperature=0.0)  # model name from /v1/models
    try:
        reply = await client.complete(messages)
    finally:
        await client.aclose()
    assert isinstance(reply.text, str) and reply.finish_reason in ("stop", "length")
    assert 0 < (reply.completion_tokens or 0) <= 8
    assert reply.prompt_tokens == len(prompt_ids)  # the server applied the model's chat template
