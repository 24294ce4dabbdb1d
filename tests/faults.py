"""Fault injection for pipeline tests, through the parts the pipeline is built from.

- `FaultySandboxBackend` wraps a real sandbox backend: chosen sandboxes disappear under their
  episode, and a command carrying `HANG` never returns.
- `ScriptedFirstTurns` wraps the embedded engine: chosen episodes open with a scripted command
  (the random tiny policy never writes one), so the agent's command path can be reached.
- `SGLangFront` serves SGLang's native HTTP API (the routes `SGLangEngine` calls) in front of an
  embedded engine on 127.0.0.1, answering chosen requests with 5xx, never, or by restarting.
- `RecordingTrainer` wraps a trainer and keeps the samples of every step it trained on.

Faults are chosen by position (the n-th sandbox, first turn or request), never by timing.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Literal

from patchgym.backends.inference.openai_server import _read_request
from patchgym.core.batch import Sample, TrainBatch
from patchgym.core.inference import Generation, InferenceEngine, SamplingParams
from patchgym.core.sandbox import DEFAULT_MAX_OUTPUT_BYTES, ExecResult, Sandbox, SandboxBackend, SandboxSpec

HANG = "patchgym-test-hang"
"""A command containing this never returns from `FaultySandbox.exec`."""


async def forever() -> None:
    """Never return (until cancelled): a hung call."""
    await asyncio.Event().wait()


class SandboxFaults:
    """Which sandboxes of train tasks are lost, by the order they were asked for (0 = first):
    each disappears after its first `after_execs` commands (easy tasks: the setup's git snapshot)."""

    def __init__(self, lose: Iterable[int] = (), after_execs: int = 1) -> None:
        self.lose, self.after_execs = set(lose), after_execs
        self.requested = 0
        self.open = self.peak_open = 0  # train-task agent sandboxes open at once
        self.lost: list[int] = []
        self.hung: list[str] = []

    def loses(self, index: int | None, execs: int) -> bool:
        """Whether sandbox `index` disappears before its command number `execs` (from 1)."""
        if index not in self.lose or execs <= self.after_execs or index in self.lost:
            return False
        self.lost.append(index)
        return True

    def next_index(self, spec: SandboxSpec) -> int | None:
        if "-train-" not in spec.labels.get("task_id", "") or spec.labels.get("role") == "grading":
            return None
        self.requested += 1
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        return self.requested - 1


class FaultySandbox(Sandbox):
    """A real sandbox that may disappear between two commands, or hang on a `HANG` command."""

    def __init__(self, inner: Sandbox, faults: SandboxFaults, index: int | None) -> None:
        self.inner, self.faults, self.index = inner, faults, index
        self.workdir = inner.workdir
        self.execs = 0
        self.closed = False

    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        if HANG in cmd:
            self.faults.hung.append(cmd)
            await forever()
        self.execs += 1
        if self.faults.loses(self.index, self.execs):
            await self.inner.close()  # gone: the backend itself now reports the loss
        return await self.inner.exec(cmd, timeout_s=timeout_s, cwd=cwd, env=env, max_output_bytes=max_output_bytes)

    async def read_file(self, path: str) -> bytes:
        return await self.inner.read_file(path)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self.inner.write_file(path, data)

    async def upload_dir(self, local_dir: Path, path: str) -> None:
        await self.inner.upload_dir(local_dir, path)

    async def download_dir(self, path: str, local_dir: Path) -> None:
        if self.faults.loses(self.index, self.execs + 1):  # gone before a fresh-sandbox grader reads it
            await self.inner.close()
        await self.inner.download_dir(path, local_dir)

    async def close(self) -> None:
        if self.index is not None and not self.closed:
            self.faults.open -= 1
        self.closed = True
        await self.inner.close()


class FaultySandboxBackend(SandboxBackend):
    name = "faulty"

    def __init__(self, inner: SandboxBackend, faults: SandboxFaults) -> None:
        self.inner, self.faults = inner, faults

    async def create(self, spec: SandboxSpec) -> Sandbox:
        index = self.faults.next_index(spec)  # in the order asked for, not the order started
        return FaultySandbox(await self.inner.create(spec), self.faults, index)

    async def reap(self, labels: Mapping[str, str]) -> int:
        return await self.inner.reap(labels)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ScriptedFirstTurns:
    """The wrapped engine, except that the n-th first turn of an episode (counted over the whole
    run, evaluation included) in `script` is that bash command, sampled with log-prob 0 like the
    pipeline's own `OraclePolicy`."""

    def __init__(self, inner: Any, tokenizer: Any, script: Mapping[int, str]) -> None:
        self.inner, self.tokenizer, self.script = inner, tokenizer, dict(script)
        self.max_context: int = inner.max_context
        self.first_turns = 0
        self._start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self._end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        if list(input_ids).count(self._start) == 3:  # system, user, assistant header: a first turn
            self.first_turns += 1
            command = self.script.get(self.first_turns - 1)
            if command is not None:
                text = f"```bash\n{command}\n```"
                tokens = [*self.tokenizer.encode(text, add_special_tokens=False), self._end]
                return Generation(tokens, [0.0] * len(tokens), "stop", self.inner.weight_version)
        return await self.inner.generate(input_ids, params)

    async def update_weights(self, weights: Any, *, version: int) -> None:
        await self.inner.update_weights(weights, version=version)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def aclose(self) -> None:
        await self.inner.aclose()


EngineFault = Literal["5xx_once", "5xx_always", "hang_once", "restart"]
"""5xx_once / hang_once: the first attempt of the request gets HTTP 503 / no answer at all;
5xx_always: every attempt gets 503; restart: once another request is in flight too, the server
goes down with every request in flight (connections cut) and comes back on the same port."""


class SGLangFront:
    """SGLang's native HTTP API in front of an in-process engine, on 127.0.0.1, with `faults` by
    the order in which /generate requests arrive (a request keeps its order over its retries);
    `restart_at_pause` n: the server restarts when the n-th /pause_generation (from 0) arrives,
    that is between two steps, as the weight sync begins."""

    def __init__(self, engine: InferenceEngine, faults: Mapping[int, EngineFault] | None = None) -> None:
        self.engine = engine
        self.faults = dict(faults or {})
        self.restart_at_pause: int | None = None
        self.pauses = 0
        self.port = 0
        self.attempts: Counter[int] = Counter()
        """/generate attempts per request (by arrival order)."""
        self.weight_versions: list[int] = []
        self.restarts = 0
        self.cut_requests = 0
        """/generate requests in flight when the server went down."""
        self.served_after_restart = 0
        self._in_flight = 0
        self._restart_pending = False
        self._order: dict[str, int] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._restarting: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> SGLangFront:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _cut_connections(self) -> None:
        cut, self._connections = self._connections, {}
        for task, writer in cut.items():
            writer.transport.abort()
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)

    async def _restart(self) -> None:
        assert self._server is not None
        self._server.close()
        await self.start()  # the same port
        self.cut_requests += self._in_flight
        await self._cut_connections()
        self.restarts += 1

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut_connections()
        if self._restarting is not None:
            await self._restarting

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while (request := await _read_request(reader, 64 << 20)) is not None:
                _, path, body, _ = request
                status, payload = await self._route(path, json.loads(body) if body else {})
                data = b"" if payload is None else json.dumps(payload).encode()
                head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                writer.write(head.encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _route(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/generate":
            return await self._generate(body)
        if path == "/pause_generation":
            self.pauses += 1
            if self.pauses - 1 == self.restart_at_pause:
                self._restarting = asyncio.create_task(self._restart())
                await forever()  # cut
            await self.engine.pause()
        elif path == "/continue_generation":
            await self.engine.resume()
        elif path == "/update_weights_from_tensor":  # as SGLang reads it: same-host shared-memory handles
            named = ForkingPickler.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            version = int(body["weight_version"])
            await self.engine.update_weights(dict(named), version=version)
            self.weight_versions.append(version)
            return 200, {"success": True, "message": "ok"}
        elif path == "/model_info":
            return 200, {"weight_version": str(self.weight_versions[-1] if self.weight_versions else 0)}
        elif path not in ("/begin_weight_update", "/end_weight_update", "/abort_request"):
            return 404, {"error": {"message": f"no route {path}"}}
        return 200, None

    async def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._in_flight += 1
        try:
            return await self._answer(body)
        finally:
            self._in_flight -= 1

    async def _answer(self, body: dict[str, Any]) -> tuple[int, Any]:
        order = self._order.setdefault(body["rid"], len(self._order))
        self.attempts[order] += 1
        fault, first = self.faults.get(order), self.attempts[order] == 1
        if fault == "5xx_always" or (fault == "5xx_once" and first):
            return 503, {"error": {"message": "injected fault: the engine is overloaded"}}
        if fault == "hang_once" and first:
            await forever()
        self._restart_pending |= fault == "restart" and first
        if self._restart_pending:  # held until a second request is in flight, then cut with the others
            if self._in_flight >= 2:
                self._restart_pending = False
                self._restarting = asyncio.create_task(self._restart())
            await forever()
        sampling = body["sampling_params"]
        params = SamplingParams(
            max_new_tokens=sampling["max_new_tokens"],
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            stop_token_ids=sampling["stop_token_ids"],
            seed=sampling.get("sampling_seed"),
        )
        out = await self.engine.generate(body["input_ids"], params)
        self.served_after_restart += self.restarts > 0
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": {"stop": "stop", "abort": "abort"}.get(out.finish_reason, "length")},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(out.token_ids),
            "weight_version": str(out.weight_version),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(out.logprobs, out.token_ids, strict=True)],
        }
        return 200, {"text": "", "output_ids": list(out.token_ids), "meta_info": meta}


class RecordingTrainer:
    """The wrapped trainer; `batches` holds the samples of every step it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batches: list[list[Sample]] = []

    @property
    def version(self) -> int:
        return int(self.inner.version)

    async def train_step(self, batch: TrainBatch, loss: Any) -> Mapping[str, float]:
        self.batches.append(list(batch.samples))
        return await self.inner.train_step(batch, loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
