"""A local stand-in for E2B: the REST control plane subset and the in-sandbox daemon (envd).

It speaks the real wire protocols so the official `e2b` SDK runs its own code paths end to
end: REST (`POST /v2/sandboxes`, `GET /v2/sandboxes`, `DELETE /sandboxes/{id}`,
`POST /sandboxes/{id}/timeout`), envd's connect-rpc services `process.Process` and
`filesystem.Filesystem` served by the SDK's generated server stubs, and envd's plain HTTP
`/files` and `/health` routes. Envd requests are routed to a sandbox by the `E2b-Sandbox-Id`
header the SDK sends (point the SDK at this server with `api_url` and `sandbox_url`).

A sandbox is a `tests.private_root.PrivateRoot`: its own `/workspace`, `/tmp` and `/home`, the
host read-only, commands run as real processes under bubblewrap. Lease expiry kills a sandbox.
Template builds are recorded, not run (a template exists once its build finished). Faults can
be injected per route through `POST /_fake/faults`.

Run: `python -m tests.fake_e2b [--port N]`; it prints `listening on PORT` once ready. Test only:
it listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof

from tests.private_root import PrivateRoot

ENVD_VERSION = "0.6.7"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class FakeSandbox:
    sandbox_id: str
    template: str
    metadata: dict[str, str]
    envs: dict[str, str]
    started_at: datetime
    end_at: float
    root: PrivateRoot
    procs: dict[int, asyncio.subprocess.Process] = field(default_factory=dict)


class FakeE2B:
    """State shared by the REST and envd handlers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.faults: dict[str, list[dict[str, Any]]] = {}
        self.calls: dict[str, int] = {}
        self.builds: dict[str, str] = {}
        self.templates: dict[str, str] = {}
        """Finished builds: build id -> template name."""

    def take_fault(self, route: str) -> dict[str, Any] | None:
        self.calls[route] = self.calls.get(route, 0) + 1
        queue = self.faults.get(route)
        return queue.pop(0) if queue else None

    def create(self, body: dict[str, Any]) -> FakeSandbox:
        sandbox_id = "fake" + secrets.token_hex(6)
        disk = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self.root))
        network = bool(body.get("allow_internet_access", True))
        box = FakeSandbox(
            sandbox_id=sandbox_id,
            template=body.get("templateID", "base"),
            metadata=dict(body.get("metadata") or {}),
            envs=dict(body.get("envVars") or {}),
            root=PrivateRoot(disk, sandbox_id, network=network),
            started_at=datetime.now(UTC),
            end_at=time.time() + float(body.get("timeout", 15)),
        )
        self.sandboxes[sandbox_id] = box
        return box

    def kill(self, sandbox_id: str) -> bool:
        box = self.sandboxes.pop(sandbox_id, None)
        if box is None:
            return False
        box.root.destroy()
        return True

    def live(self, sandbox_id: str | None) -> FakeSandbox | None:
        box = self.sandboxes.get(sandbox_id or "")
        if box is not None and box.end_at < time.time():
            self.kill(box.sandbox_id)
            return None
        return box

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for sandbox_id in list(self.sandboxes):
                self.live(sandbox_id)


def _listed(box: FakeSandbox) -> dict[str, Any]:
    return {
        "templateID": box.template,
        "sandboxID": box.sandbox_id,
        "clientID": "fake",
        "startedAt": box.started_at.isoformat(),
        "endAt": datetime.fromtimestamp(box.end_at, UTC).isoformat(),
        "cpuCount": 2,
        "memoryMB": 512,
        "diskSizeMB": 1024,
        "state": "running",
        "envdVersion": ENVD_VERSION,
        "metadata": box.metadata,
    }


class ProcessService(Process):
    """`process.Process`: Start, Connect (not kept), List, SendSignal."""

    def __init__(self, state: FakeE2B) -> None:
        self.state = state

    def _box(self, ctx: RequestContext[Any, Any]) -> FakeSandbox:
        box = self.state.live(ctx.request_headers.get("e2b-sandbox-id"))
        if box is None:
            raise ConnectError(Code.UNAVAILABLE, "The sandbox was not found")
        return box

    async def start(self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        box = self._box(ctx)
        config = request.process
        env = box.root.env(box.envs, dict(config.envs or {}))
        cwd = config.cwd or "/home/user"
        if not box.root.host_path(cwd).is_dir():
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist")
        proc = await asyncio.create_subprocess_exec(
            *box.root.argv(config.cmd, list(config.args), cwd),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        box.procs[proc.pid] = proc
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(maxsize=16)

        async def pump(name: str, stream: asyncio.StreamReader) -> None:
            while chunk := await stream.read(1 << 15):
                await queue.put((name, chunk))
            await queue.put(None)

        assert proc.stdout is not None and proc.stderr is not None
        pumps = [asyncio.create_task(pump("stdout", proc.stdout)), asyncio.create_task(pump("stderr", proc.stderr))]
        event = process_pb.ProcessEvent
        try:
            yield process_pb.StartResponse(event=event(event=Oneof("start", event.StartEvent(pid=proc.pid))))
            if self.state.take_fault("start-drop") is not None:
                return  # the stream ends without an end event, as when a connection drops
            open_streams = 2
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                data = event.DataEvent(output=Oneof(item[0], item[1]))
                yield process_pb.StartResponse(event=event(event=Oneof("data", data)))
            code = await proc.wait()
            end = event.EndEvent(exit_code=code if code >= 0 else 128 - code, exited=True, status=f"exit {code}")
            yield process_pb.StartResponse(event=event(event=Oneof("end", end)))
        finally:
            # envd ends the process when the stream's context ends (deadline or client gone).
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            for task in pumps:
                task.cancel()
            box.procs.pop(proc.pid, None)

    async def send_signal(
        self, request: process_pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.SendSignalResponse:
        box = self._box(ctx)
        pid = request.process.selector.value if request.process and request.process.selector else 0
        proc = box.procs.get(pid)
        if proc is None:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        sig = signal.SIGKILL if request.signal == process_pb.Signal.SIGKILL else signal.SIGTERM
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        return process_pb.SendSignalResponse()

    async def list(self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]) -> process_pb.ListResponse:
        box = self._box(ctx)
        return process_pb.ListResponse(processes=[process_pb.ProcessInfo(pid=pid) for pid in box.procs])


def _entry(path: str, host: Path) -> filesystem_pb.EntryInfo:
    info = host.lstat()
    link = stat.S_ISLNK(info.st_mode)
    target = os.path.realpath(host) if link else None
    kind = filesystem_pb.FileType.DIRECTORY if host.is_dir() else filesystem_pb.FileType.FILE
    return filesystem_pb.EntryInfo(
        name=os.path.basename(path),
        type=kind,
        path=path,
        size=info.st_size,
        mode=info.st_mode & 0o777,
        permissions=stat.filemode(info.st_mode),
        owner="user",
        group="user",
        symlink_target=os.readlink(host) if target else None,
        is_symlink=link,
    )


class FilesystemService(Filesystem):
    """`filesystem.Filesystem`: Stat, MakeDir, Remove, ListDir."""

    def __init__(self, state: FakeE2B) -> None:
        self.state = state

    def _resolve(self, ctx: RequestContext[Any, Any], path: str) -> Path:
        box = self.state.live(ctx.request_headers.get("e2b-sandbox-id"))
        if box is None:
            raise ConnectError(Code.UNAVAILABLE, "The sandbox was not found")
        return box.root.host_path(path)

    async def stat(self, request: filesystem_pb.StatRequest, ctx: RequestContext[Any, Any]) -> Any:
        host = self._resolve(ctx, request.path)
        if not os.path.lexists(host):
            raise ConnectError(Code.NOT_FOUND, f"no such file or directory: {request.path}")
        return filesystem_pb.StatResponse(entry=_entry(request.path, host))

    async def make_dir(self, request: filesystem_pb.MakeDirRequest, ctx: RequestContext[Any, Any]) -> Any:
        host = self._resolve(ctx, request.path)
        if host.exists():
            raise ConnectError(Code.ALREADY_EXISTS, f"directory exists: {request.path}")
        host.mkdir(parents=True)
        return filesystem_pb.MakeDirResponse(entry=_entry(request.path, host))

    async def remove(self, request: filesystem_pb.RemoveRequest, ctx: RequestContext[Any, Any]) -> Any:
        host = self._resolve(ctx, request.path)
        if host.is_dir() and not host.is_symlink():
            shutil.rmtree(host)
        else:
            host.unlink(missing_ok=True)
        return filesystem_pb.RemoveResponse()

    async def list_dir(self, request: filesystem_pb.ListDirRequest, ctx: RequestContext[Any, Any]) -> Any:
        host = self._resolve(ctx, request.path)
        if not host.is_dir():
            raise ConnectError(Code.NOT_FOUND, f"no such directory: {request.path}")
        entries = [_entry(f"{request.path.rstrip('/')}/{child.name}", child) for child in sorted(host.iterdir())]
        return filesystem_pb.ListDirResponse(entries=entries)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, payload: Any = None, headers: dict[str, str] | None = None) -> None:
    body = b"" if payload is None else json.dumps(payload).encode()
    raw = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in (headers or {}).items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class FakeE2BApp:
    """The ASGI application: REST routes, envd routes, fault injection."""

    def __init__(self, state: FakeE2B) -> None:
        self.state = state
        self.process = ProcessASGIApplication(ProcessService(state))
        self.filesystem = FilesystemASGIApplication(FilesystemService(state))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            if message["type"] == "lifespan.startup":
                asyncio.get_running_loop().create_task(self.state.expire_forever())
                await send({"type": "lifespan.startup.complete"})
            return
        path: str = scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        route = self._route_name(scope["method"], path)
        fault = self.state.take_fault(route) if route else None
        if fault is not None:
            message = {"code": fault["status"], "message": fault.get("message", "fault")}
            await _respond(send, fault["status"], message, fault.get("headers"))
            return
        if path.startswith("/process.Process/"):
            await self.process(scope, receive, send)  # type: ignore[arg-type]
        elif path.startswith("/filesystem.Filesystem/"):
            await self.filesystem(scope, receive, send)  # type: ignore[arg-type]
        elif path in ("/files", "/health"):
            await self._envd_http(scope, receive, send, headers)
        else:
            await self._rest(scope, receive, send, headers)

    @staticmethod
    def _route_name(method: str, path: str) -> str:
        if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
            return path.rsplit("/", 1)[1].lower()
        if path.startswith("/sandboxes/") and path.endswith("/timeout"):
            return "timeout"
        if path == "/v3/templates":
            return "template-build"
        return {"POST": "create", "GET": "list", "DELETE": "kill"}.get(method, "") if "sandboxes" in path else path

    async def _envd_http(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        box = self.state.live(headers.get("e2b-sandbox-id"))
        if box is None:
            await _respond(send, 502, {"code": 502, "message": "The sandbox was not found"})
            return
        if scope["path"] == "/health":
            await _respond(send, 204)
            return
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode()))
        host = box.root.host_path(query.get("path", ""))
        if scope["method"] == "GET":
            if not host.is_file():
                await _respond(send, 404, {"code": 404, "message": f"path '{query.get('path')}' does not exist"})
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream")],
                }
            )
            with host.open("rb") as handle:
                while chunk := handle.read(1 << 16):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if headers.get("content-type") != "application/octet-stream":
            await _respond(send, 400, {"code": 400, "message": "this fake accepts octet-stream uploads only"})
            return
        if not box.root.writable(host):
            await _respond(send, 403, {"code": 403, "message": f"permission denied: {query.get('path')}"})
            return
        try:
            host.parent.mkdir(parents=True, exist_ok=True)
            with host.open("wb") as handle:
                while True:
                    message = await receive()
                    handle.write(message.get("body", b""))
                    if not message.get("more_body"):
                        break
        except OSError as exc:
            await _respond(send, 403 if isinstance(exc, PermissionError) else 400, {"code": 400, "message": str(exc)})
            return
        path = query["path"]
        await _respond(send, 200, [{"name": os.path.basename(path), "type": "file", "path": path}])

    async def _rest(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        method, parts = scope["method"], scope["path"].strip("/").split("/")
        if "x-api-key" not in headers:
            await _respond(send, 401, {"code": 401, "message": "missing X-API-KEY"})
            return
        if method == "POST" and parts == ["_fake", "faults"]:
            for route, fault in json.loads(await _body(receive)).items():
                self.state.faults.setdefault(route, []).extend(fault)
            await _respond(send, 204)
        elif method == "GET" and parts == ["_fake", "calls"]:
            await _respond(send, 200, self.state.calls)
        elif method == "POST" and parts == ["v2", "sandboxes"]:
            box = self.state.create(json.loads(await _body(receive)))
            await _respond(
                send,
                201,
                {
                    "templateID": box.template,
                    "sandboxID": box.sandbox_id,
                    "clientID": "fake",
                    "envdVersion": ENVD_VERSION,
                },
            )
        elif method == "GET" and parts == ["v2", "sandboxes"]:
            query = dict(urllib.parse.parse_qsl(scope["query_string"].decode()))
            wanted = dict(urllib.parse.parse_qsl(query.get("metadata", "")))
            boxes = [self.state.live(i) for i in list(self.state.sandboxes)]
            found = [_listed(b) for b in boxes if b and all(b.metadata.get(k) == v for k, v in wanted.items())]
            await _respond(send, 200, found)
        elif parts[0] in ("templates", "v3", "v2") and "sandboxes" not in parts:
            await self._templates(method, parts, receive, send)
        elif len(parts) >= 2 and parts[0] == "sandboxes" and self.state.live(parts[1]) is None:
            await _respond(send, 404, {"code": 404, "message": f"sandbox {parts[1]} not found"})
        elif method == "DELETE" and len(parts) == 2:
            self.state.kill(parts[1])
            await _respond(send, 204)
        elif method == "POST" and len(parts) == 3 and parts[2] == "timeout":
            self.state.sandboxes[parts[1]].end_at = time.time() + float(json.loads(await _body(receive))["timeout"])
            await _respond(send, 204)
        else:
            await _respond(send, 404, {"code": 404, "message": f"no route {method} {scope['path']}"})

    async def _templates(self, method: str, parts: list[str], receive: Receive, send: Send) -> None:
        """Template builds are recorded, not run: every sandbox runs this host's tools."""
        templates = self.state.templates
        if method == "GET" and parts[:2] == ["templates", "aliases"]:
            found = parts[2] in templates.values()
            missing = {"code": 404, "message": f"template '{parts[2]}' not found"}
            await _respond(send, *((200, {"templateID": parts[2], "public": False}) if found else (404, missing)))
        elif method == "POST" and parts == ["v3", "templates"]:
            name = json.loads(await _body(receive))["name"]
            template_id, build_id = "tpl" + secrets.token_hex(4), "build" + secrets.token_hex(4)
            self.state.builds[build_id] = name
            reply = {"templateID": template_id, "buildID": build_id, "public": False, "tags": ["default"]}
            await _respond(send, 202, {**reply, "names": [name], "aliases": [name]})
        elif method == "GET" and len(parts) == 4 and parts[2] == "files":
            await _respond(send, 201, {"present": True})
        elif method == "POST" and len(parts) == 5 and parts[3] == "builds":
            await _body(receive)
            await _respond(send, 202)
        elif method == "GET" and len(parts) == 5 and parts[4] == "status":
            build_id = parts[3]
            failed = self.state.take_fault("build-error") is not None
            if not failed:
                templates[build_id] = self.state.builds[build_id]
            status = {"templateID": parts[1], "buildID": build_id, "logs": [], "logEntries": []}
            if failed:
                status |= {"status": "error", "reason": {"message": "step 1 failed: injected build error"}}
            await _respond(send, 200, {"status": "ready", **status})
        else:
            await _respond(send, 404, {"code": 404, "message": f"no template route {method} {'/'.join(parts)}"})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fake-e2b-") as root:
        state = FakeE2B(Path(root))
        config = uvicorn.Config(FakeE2BApp(state), host="127.0.0.1", port=args.port, log_level="warning")
        server = uvicorn.Server(config)

        async def serve() -> None:
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"listening on {port}", flush=True)
            await task

        try:
            asyncio.run(serve())
        finally:
            for sandbox_id in list(state.sandboxes):
                state.kill(sandbox_id)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
