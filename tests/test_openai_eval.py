"""The OpenAI-compatible client and text-level eval, against a local chat-completions server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from patchgym.backends.inference.openai import OpenAIChatModel
from patchgym.backends.inference.openai_server import ChatCompletionsServer, completion_body
from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.cli import app
from patchgym.core.errors import ConfigError, TransportError
from patchgym.core.plugins import registry
from patchgym.core.validation import apply_patch_command
from patchgym.envs.chat_eval import evaluate
from tests.processes import ignore_sigint, kill_survivors

TASKS = registry().create("task_set", "tiny")
HELLO = [{"role": "user", "content": "hello"}]


class GoldAgent:
    """A scripted chat model: applies the task's gold patch, then submits."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        messages = request["messages"]
        task = next(t for t in TASKS if t.instruction.strip() in messages[1]["content"])
        if sum(m["role"] == "assistant" for m in messages) == 0:
            text = f"Apply the fix.\n```bash\n{apply_patch_command(task.gold_patch or '')}\n```"
        else:
            text = "Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"
        return completion_body(request["model"], text, "stop", 10, 5)


class Flaky:
    """Fails `failures` times with an exception (HTTP 500), then answers."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("engine hiccup")
        return completion_body(request["model"], f"answer to {request['messages'][-1]['content']}", "stop", 3, 4)


async def test_eval_with_a_scripted_gold_agent_passes_every_task(tmp_path: Path) -> None:
    async with ChatCompletionsServer(GoldAgent(), model_name="gold") as server:
        model = OpenAIChatModel(server.url, max_connections=3, retry_backoff_s=0.01)
        backend = LocalSandboxBackend()
        try:
            report = await evaluate(model, TASKS, backend, attempts=2, concurrency=3, task_ids=TASKS.ids()[:3])
        finally:
            await model.aclose()
            await backend.aclose()
    assert model.model == "gold"  # discovered at /v1/models
    assert report.pass_at_1 == 1.0 and report.infra_errors == 0 and len(report.trajectories) == 6
    assert {t.termination for t in report.trajectories} == {"submitted"}
    assert all(t.turns[0].llm_s > 0 for t in report.trajectories)
    assert report.as_dict()["settings"]["model"]["max_connections"] == 3


async def test_5xx_is_retried_then_an_infra_error() -> None:
    flaky = Flaky(failures=2)
    async with ChatCompletionsServer(flaky) as server:
        model = OpenAIChatModel(server.url, "m", max_retries=2, retry_backoff_s=0.01)
        reply = await model.complete(HELLO)
        assert reply.text == "answer to hello" and reply.finish_reason == "stop" and reply.completion_tokens == 4
        assert flaky.calls == 3
        flaky.calls = 0
        impatient = OpenAIChatModel(server.url, "m", max_retries=1, retry_backoff_s=0.01)
        with pytest.raises(TransportError, match="500.*engine hiccup"):
            await impatient.complete(HELLO)
        await model.aclose()
        await impatient.aclose()


async def test_client_errors_are_config_errors_and_a_dead_server_is_transport() -> None:
    async def refuse(request: dict[str, Any]) -> dict[str, Any]:
        raise ConfigError("model 'nope' does not exist")

    async with ChatCompletionsServer(refuse) as server:
        model = OpenAIChatModel(server.url + "/", "nope", retry_backoff_s=0.01)
        with pytest.raises(ConfigError, match="400.*does not exist"):
            await model.complete(HELLO)
        await model.aclose()
        port = server.port
    dead = OpenAIChatModel(f"http://127.0.0.1:{port}", "m", max_retries=1, retry_backoff_s=0.01)
    with pytest.raises(TransportError, match="ConnectError"):
        await dead.complete(HELLO)
    await dead.aclose()
    with pytest.raises(ConfigError, match="http://"):
        OpenAIChatModel("127.0.0.1:8000")


async def test_a_model_outage_is_an_infra_error_not_a_failure() -> None:
    async with ChatCompletionsServer(Flaky(failures=10**6)) as server:
        model = OpenAIChatModel(server.url, "m", max_retries=0)
        backend = LocalSandboxBackend()
        try:
            report = await evaluate(model, TASKS, backend, task_ids=TASKS.ids()[:2])
        finally:
            await model.aclose()
            await backend.aclose()
    assert report.infra_errors == 2 and report.pass_at_1 is None
    assert all(t.infra_error["kind"] == "transport" and t.reward is None for t in report.trajectories)


async def test_engine_backed_server_speaks_chat_completions(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from patchgym.backends.inference.embedded import EmbeddedEngine
    from patchgym.backends.inference.openai_server import EngineChatHandler

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = EmbeddedEngine(tiny_model_dir, max_context=1024)
    try:
        async with ChatCompletionsServer(EngineChatHandler(engine, tokenizer, model_name="tiny")) as server:
            model = OpenAIChatModel(server.url, max_tokens=12, temperature=0)
            replies = await asyncio.gather(*(model.complete(HELLO) for _ in range(4)))
            assert len({r.text for r in replies}) == 1  # greedy: the same answer every time
            prompt = tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
            assert replies[0].prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
            assert replies[0].completion_tokens <= 12
            backend = LocalSandboxBackend()
            try:
                report = await evaluate(model, TASKS, backend, config={"max_turns": 2}, task_ids=TASKS.ids()[:1])
            finally:
                await backend.aclose()
            await model.aclose()
    finally:
        await engine.aclose()
    (trajectory,) = report.trajectories
    assert trajectory.infra_error is None and trajectory.reward == 0.0  # a random model fixes nothing


@pytest.fixture
def threaded_gold_server() -> Iterator[str]:
    """The gold agent's server on its own event loop thread (the CLI runs its own loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(ChatCompletionsServer(GoldAgent()).start(), loop).result()
    yield server.url
    asyncio.run_coroutine_threadsafe(server.aclose(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_cli_eval(threaded_gold_server: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["eval", "--model-url", threaded_gold_server, "--task-set", "tiny", "--limit", "2", "--json"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["pass_at_1"] == 1.0 and summary["episodes"] == 2
    assert len(json.loads(out.read_text())["trajectories"]) == 2
    bad = CliRunner().invoke(app, ["eval", "--model-url", "localhost:1", "--task-set", "tiny"])
    assert bad.exit_code == 2 and "http://" in bad.output


async def test_cli_model_serve(tiny_model_dir: Path) -> None:
    """`patchgym model serve` answers chat completions until interrupted; Ctrl-C stops it even when it
    was started with SIGINT ignored (as a shell's background job, CI, starts it)."""
    import os
    import re
    import signal
    import sys

    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "patchgym.cli", "model", "serve", str(tiny_model_dir)],
        *["--port", "0", "--max-context", "512"],
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "300"},
        start_new_session=True,
        preexec_fn=ignore_sigint,
    )
    try:
        assert process.stdout is not None
        line = (await process.stdout.readline()).decode()  # the test's own timeout bounds the start
        url = re.search(r"http://127\.0\.0\.1:\d+/v1", line)
        assert url, line
        model = OpenAIChatModel(url.group(0), max_tokens=5)
        reply = await model.complete(HELLO)
        await model.aclose()
        assert model.model == tiny_model_dir.name and reply.completion_tokens is not None
        assert reply.completion_tokens <= 5
        process.send_signal(signal.SIGINT)
        assert await process.wait() == 0  # bounded by the test's timeout; a hang fails, never passes
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        survivors = kill_survivors({process.pid})
    assert not survivors, "a process of the server outlived it"
