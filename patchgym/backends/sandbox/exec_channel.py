"""The host end of a container's exec channel: commands over one long-lived exec stream.

A plain `docker exec` starts a new process through runc for every command, which costs tens
of milliseconds of CPU. The channel instead starts `exec_server` once per container, on an
exec stream whose stdin carries requests and whose stdout carries results (both framed, see
`exec_server`), so a command costs a fork and an exec inside the container.

- The server needs a Python in the image. Without one (the server never says hello) the
  channel reports `path == "exec"` and the sandbox falls back to plain exec.
- If the server dies while the container still runs, a command in the sandbox killed it
  (`kill -9 -1`, killing its pid): the commands in flight fail as the agent's doing (exit
  137 with a note on stderr) and the next command starts a new server.
- A stream that breaks while the server still runs, or a container that is gone, is an
  infrastructure fault (`TransportError`, `SandboxLostError`). A container that stopped by
  itself while a command ran is lost from inside (`SandboxLostError.from_inside`): the agent's
  doing, scored 0 and never retried.
Each sandbox has its own channel, never shared: a fresh sandbox starts a fresh server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from patchgym.core.errors import InfraError, SandboxLostError, TransportError
from patchgym.core.output import CappedBuffer
from patchgym.core.sandbox import ExecResult

HEADER = struct.Struct(">IBI")
_DOCKER_HEADER = struct.Struct(">BxxxI")
_SERVER_SOURCE = Path(__file__).with_name("exec_server.py").read_text()
"""Read once at import: a later rewrite of the file does not reach the sandboxes."""
_LAUNCH = 'for p in python3 python; do command -v "$p" >/dev/null 2>&1 && exec "$p" -c "$0"; done; exit 127'
SERVER_KILLED_NOTE = (
    "patchgym: the sandbox's exec server was killed while this command ran (a command in the sandbox "
    "killed it); the next command starts a new one\n"
)

ExecPath = Literal["channel", "exec"]
Call = Callable[..., Awaitable[Any]]
"""Runs a blocking Docker SDK call off the event loop, mapping its faults onto InfraErrors."""


def launch_argv() -> list[str]:
    """The exec that starts the server with the image's python3 (or python); exit 127 if none."""
    return ["sh", "-c", _LAUNCH, _SERVER_SOURCE]


class _Server:
    """One started server: requests go out on `writer`, results come back on `reader`."""

    def __init__(self, exec_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.exec_id = exec_id
        self.reader = reader
        self.writer = writer
        self.pid: int | None = None
        self.pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self.diagnostics = bytearray()
        self.task: asyncio.Task[None] | None = None

    def send(self, kind: bytes, cid: int, body: bytes = b"") -> None:
        if not self.writer.is_closing():
            self.writer.write(HEADER.pack(len(body), kind[0], cid) + body)

    async def read_frames(self) -> None:
        """Demultiplex Docker's stream frames, then our frames; resolve the waiting commands."""
        inbox = bytearray()
        while True:
            kind, size = _DOCKER_HEADER.unpack(await self.reader.readexactly(_DOCKER_HEADER.size))
            payload = await self.reader.readexactly(size)
            if kind != 1:
                self.diagnostics = (self.diagnostics + payload)[-4000:]
                continue
            inbox += payload
            while len(inbox) >= HEADER.size:
                length, frame_kind, cid = HEADER.unpack_from(inbox)
                if len(inbox) < HEADER.size + length:
                    break
                body = bytes(inbox[HEADER.size : HEADER.size + length])
                del inbox[: HEADER.size + length]
                self._deliver(chr(frame_kind), cid, body)

    def _deliver(self, kind: str, cid: int, body: bytes) -> None:
        future = self.pending.pop(cid, None)
        if future is None or future.done():
            return
        if kind == "H":
            future.set_result((json.loads(body), b""))
        elif kind == "E":
            (size,) = struct.unpack_from(">I", body)
            future.set_result((json.loads(body[4 : 4 + size]), body[4 + size :]))
        else:
            future.set_exception(TransportError(f"the exec channel sent an unknown frame kind {kind!r}"))

    def fail_pending(self, fault: BaseException | None) -> None:
        """End the waiting commands: with `fault`, or (None) as killed along with the server."""
        for future in self.pending.values():
            if future.done():
                continue
            if fault is None:
                future.set_result(({"killed": True}, b""))
            else:
                future.set_exception(fault)
        self.pending.clear()

    def close(self) -> None:
        self.writer.close()
        if self.task is not None:
            self.task.cancel()


def _result(meta: dict[str, Any], blob: bytes, limit: int, duration: float) -> ExecResult:
    """An ExecResult from an `E` frame: head and tail of each stream, and what was left out."""
    buffers = [CappedBuffer(limit), CappedBuffer(limit)]
    offset = 0
    for buffer, (head, tail, omitted) in zip(buffers, meta["streams"], strict=True):
        buffer.write(blob[offset : offset + head])
        buffer.omit(omitted)
        buffer.write(blob[offset + head : offset + head + tail])
        offset += head + tail
    stdout, stderr = buffers
    return ExecResult(
        exit_code=meta["exit_code"],
        stdout=stdout.text(),
        stderr=stderr.text(),
        timed_out=meta["timed_out"],
        truncated=stdout.truncated or stderr.truncated,
        duration_s=duration,
    )


class ExecChannel:
    """The exec channel of one container; see the module docstring.

    `call` runs blocking SDK calls (see `Call`); `grace_s` is the time between SIGTERM and
    SIGKILL on timeout, and also how long a command's pipes may stay open after it exits;
    `start_timeout_s` bounds how long the server may take to say hello.
    """

    def __init__(
        self,
        api: Any,
        container_id: str,
        call: Call,
        *,
        grace_s: float,
        start_timeout_s: float,
        paths: Counter[str],
    ) -> None:
        self._api = api
        self._container_id = container_id
        self._call = call
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.path: ExecPath | None = None
        """"channel" once a server said hello, "exec" when the image cannot run one; None before."""
        self.fallback_reason = ""
        self._paths = paths
        self.restarts = 0
        self._server: _Server | None = None
        self._starting: asyncio.Future[_Server | None] | None = None
        self._ids = itertools.count(1)
        self._closed = False

    # -- running commands -----------------------------------------------------------------
    async def exec(
        self, cmd: str, *, timeout_s: float, workdir: str, env: Mapping[str, str], limit: int
    ) -> ExecResult | None:
        """Run `cmd` over the channel; None when this container has no channel (use plain exec)."""
        server = await self._ensure_server()
        if server is None:
            return None
        cid = next(self._ids)
        request = {
            "cmd": cmd,
            "cwd": workdir,
            "env": dict(env),
            "timeout_s": max(timeout_s, 0.001),
            "grace_s": self.grace_s,
            "drain_s": self.grace_s,
            "limit": limit,
        }
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = asyncio.get_running_loop().create_future()
        server.pending[cid] = future
        started = time.perf_counter()
        server.send(b"R", cid, json.dumps(request).encode())
        try:
            meta, blob = await asyncio.wait_for(asyncio.shield(future), timeout_s + 3 * self.grace_s + 5)
        except (TimeoutError, asyncio.CancelledError) as exc:
            server.pending.pop(cid, None)
            server.send(b"K", cid)
            if isinstance(exc, asyncio.CancelledError):
                raise
            meta, blob = {"exit_code": None, "timed_out": True, "streams": [[0, 0, 0], [0, 0, 0]]}, b""
        duration = time.perf_counter() - started
        if meta.get("killed"):
            return ExecResult(exit_code=137, stdout="", stderr=SERVER_KILLED_NOTE, duration_s=duration)
        return _result(meta, blob, limit, duration)

    # -- starting and losing the server ---------------------------------------------------
    async def _ensure_server(self) -> _Server | None:
        if self._closed:
            raise SandboxLostError("this sandbox is closed; create a new one")
        if self.path == "exec":
            return None
        if self._server is not None:
            return self._server
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        starting = self._starting
        try:
            return await asyncio.shield(starting)
        finally:
            if self._starting is starting and starting.done():
                self._starting = None

    async def _start(self) -> _Server | None:
        exec_id, sock = await self._call(self._open_stream)
        if sock is None:
            return self._fall_back("the Docker engine's stream is not a plain socket (TLS?)")
        reader, writer = await asyncio.open_connection(sock=sock)
        server = _Server(exec_id, reader, writer)
        hello: asyncio.Future[tuple[dict[str, Any], bytes]] = asyncio.get_running_loop().create_future()
        server.pending[0] = hello
        server.task = asyncio.ensure_future(self._serve(server))
        server.send(b"H", 0)
        try:
            info, _ = await asyncio.wait_for(asyncio.shield(hello), self.start_timeout_s)
        except (TimeoutError, InfraError) as exc:
            server.close()
            said = server.diagnostics.decode(errors="replace").strip()[-500:]
            return self._fall_back(f"the exec server did not start ({exc or 'timed out'}){f': {said}' if said else ''}")
        server.pid = info["pid"]
        if self.path is None:
            self.path = "channel"
            self._paths["channel"] += 1
        self._server = server
        return server

    def _fall_back(self, reason: str) -> None:
        """Plain exec from now on for this container (no Python in the image, or it cannot run the server)."""
        if self.path != "exec":
            self._paths["exec"] += 1
            if self.path == "channel":
                self._paths["channel"] -= 1
        self.path = "exec"
        self.fallback_reason = reason

    def _open_stream(self) -> tuple[str, socket.socket | None]:
        """Create and start the server's exec; its socket, or None if it is not a plain socket."""
        exec_id = self._api.exec_create(self._container_id, launch_argv(), stdin=True)["Id"]
        stream = self._api.exec_start(exec_id, socket=True)
        raw = getattr(stream, "_sock", stream)
        if type(raw) is not socket.socket:  # a TLS connection to the engine: keep to plain exec
            stream.close()
            return exec_id, None
        # a socket of our own, so closing the SDK's wrappers (and its HTTP response) is harmless
        sock = socket.socket(raw.family, raw.type, fileno=os.dup(raw.fileno()))
        stream.close()
        with contextlib.suppress(Exception):
            stream._response.close()
        return exec_id, sock

    async def _serve(self, server: _Server) -> None:
        """Read results until the stream ends, then settle the commands still waiting."""
        try:
            await server.read_frames()
        except asyncio.CancelledError:
            server.fail_pending(SandboxLostError("this sandbox is closed; create a new one"))
            raise
        except (asyncio.IncompleteReadError, OSError, ValueError, struct.error):
            pass
        if self._server is server:
            self._server = None
        server.writer.close()
        if not server.pending:
            return
        try:
            fault = await self._why_lost(server)
        except InfraError as exc:
            fault = exc
        server.fail_pending(fault)

    async def _why_lost(self, server: _Server) -> InfraError | None:
        """The agent's doing (the server died, the container runs) or an infrastructure fault."""
        if server.pid is None:
            return TransportError("the exec channel ended before its server started")
        state = (await self._call(self._api.inspect_container, self._container_id))["State"]
        if not state.get("Running"):
            why = f"exit code {state.get('ExitCode')}" + (", OOM-killed" if state.get("OOMKilled") else "")
            return SandboxLostError(
                f"the container stopped by itself ({why}) while a command ran: its own processes ended it",
                retryable=False,
                from_inside=True,
            )
        run = await self._call(self._api.exec_inspect, server.exec_id)
        if not run["Running"] and (run["ExitCode"] or 0) >= 128:  # killed by a signal from inside
            self.restarts += 1
            return None
        if run["Running"]:  # the stream broke under a live server: stop it, so its commands do not run unseen
            with contextlib.suppress(InfraError):
                await self._call(self._kill_server, server.pid)
        tail = server.diagnostics.decode(errors="replace").strip()
        return TransportError(f"the exec channel's stream to the Docker engine broke{f': {tail}' if tail else ''}")

    def _kill_server(self, pid: int) -> None:
        exec_id = self._api.exec_create(self._container_id, ["kill", "-9", str(pid)])["Id"]
        self._api.exec_start(exec_id)

    async def close(self) -> None:
        """Stop the server (it kills its running commands when its stdin closes)."""
        self._closed = True
        if self._starting is not None:
            with contextlib.suppress(Exception):
                await self._starting
        if self._server is not None:
            self._server.close()
            self._server = None
