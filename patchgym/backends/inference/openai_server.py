"""A small OpenAI-compatible chat-completions server (asyncio, HTTP/1.1, keep-alive), on 127.0.0.1.

It serves `POST /v1/chat/completions` (non-streaming) and `GET /v1/models` in the OpenAI wire
format, answering with any `ChatHandler`. `EngineChatHandler` puts a token-level
`InferenceEngine` (e.g. the embedded engine) and a tokenizer's chat template behind it, so a
local model can be evaluated exactly like a hosted one. Errors are answered as OpenAI error
objects (`{"error": {"message", "type", "code"}}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from patchgym.core.chat import ChatTokenizer
from patchgym.core.errors import ConfigError
from patchgym.core.inference import InferenceEngine, SamplingParams

ChatHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Takes a chat-completions request body, returns the response body."""
KeyedChatHandler = Callable[[dict[str, Any], str | None], Awaitable[dict[str, Any]]]
"""Takes the request body and the request's API key (`Authorization: Bearer KEY`), returns the response body."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChatCompletionsServer:
    """Serve `handler` at http://127.0.0.1:PORT/v1 (`port=0` picks a free port; see `url`)."""

    def __init__(
        self,
        handler: ChatHandler | None = None,
        *,
        model_name: str = "patchgym-local",
        port: int = 0,
        max_body_bytes: int = 16 << 20,
        keyed_handler: KeyedChatHandler | None = None,
        close_grace_s: float = 30.0,
    ) -> None:
        """`handler` answers every request; `keyed_handler` (instead) also gets the request's API key.
        `close_grace_s`: how long `aclose` lets requests in progress finish before cancelling them."""
        self.close_grace_s = close_grace_s
        if (handler is None) == (keyed_handler is None):
            raise ValueError("give exactly one of handler and keyed_handler")
        self.handler, self.keyed_handler = handler, keyed_handler
        self.model_name, self.port, self.max_body_bytes = model_name, port, max_body_bytes
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> ChatCompletionsServer:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and end the open (keep-alive) connections."""
        if self._server is not None:
            self._server.close()
            for writer in self._connections.values():  # idle keep-alive connections end at once
                writer.close()
            if self._connections:
                _, late = await asyncio.wait(list(self._connections), timeout=self.close_grace_s)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
            await self._server.wait_closed()

    async def __aenter__(self) -> ChatCompletionsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while True:
                request = await _read_request(reader, self.max_body_bytes)
                if request is None:
                    return
                method, path, body, key = request
                status, payload = await self._dispatch(method, path, body, key)
                data = json.dumps(payload).encode()
                head = (
                    f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n"
                )
                writer.write(head.encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _dispatch(self, method: str, path: str, body: bytes, key: str | None) -> tuple[int, dict[str, Any]]:
        try:
            if path.rstrip("/") == "/v1/models":
                if method != "GET":
                    raise HTTPError(405, "use GET")
                return 200, {
                    "object": "list",
                    "data": [{"id": self.model_name, "object": "model", "owned_by": "local"}],
                }
            if path.rstrip("/") != "/v1/chat/completions":
                raise HTTPError(404, f"no route {path}")
            if method != "POST":
                raise HTTPError(405, "use POST")
            try:
                request = json.loads(body)
            except ValueError as exc:
                raise HTTPError(400, f"the body is not JSON: {exc}") from exc
            if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
                raise HTTPError(400, "the body needs a 'messages' list")
            if request.get("stream"):
                raise HTTPError(400, "streaming is not supported by this server; send stream=false")
            if self.keyed_handler is not None:
                return 200, await self.keyed_handler(request, key)
            assert self.handler is not None
            return 200, await self.handler(request)
        except HTTPError as exc:
            return exc.status, _error(exc.status, str(exc))
        except ConfigError as exc:
            return 400, _error(400, str(exc))
        except Exception as exc:  # the handler failed: the client sees a 500, the server keeps serving
            return 500, _error(500, f"{type(exc).__name__}: {exc}")


def _error(status: int, message: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


async def _read_request(reader: asyncio.StreamReader, max_body: int) -> tuple[str, str, bytes, str | None] | None:
    """(method, path, body, bearer key) of the next request, or None at the end of the connection."""
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode("latin-1").split(" ", 2)
    length, key = 0, None
    while True:
        header = (await reader.readline()).decode("latin-1").strip()
        if not header:
            break
        name, _, value = header.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        if name.strip().lower() == "authorization" and value.strip().lower().startswith("bearer "):
            key = value.strip()[7:].strip()
    if length > max_body:
        raise ConnectionError(f"request body of {length} bytes is over the limit")
    return method, path, await reader.readexactly(length), key


def completion_body(model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """A chat-completions response body in the OpenAI wire format."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class EngineChatHandler:
    """Answer chat completions with a token-level engine and the tokenizer's chat template."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer, *, model_name: str = "patchgym-local"):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.stop_token_ids = [tokenizer.convert_tokens_to_ids(tokenizer.eos_token)]  # type: ignore[attr-defined]

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        text = self.tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(
            max_new_tokens=int(request.get("max_tokens") or request.get("max_completion_tokens") or 256),
            temperature=float(request.get("temperature", 1.0)),
            top_p=float(request.get("top_p", 1.0)),
            stop_token_ids=self.stop_token_ids,
            seed=request.get("seed"),
        )
        generation = await self.engine.generate(prompt, params)
        tokens = list(generation.token_ids)
        if generation.finish_reason == "stop":
            tokens = tokens[:-1]
        reason = "stop" if generation.finish_reason == "stop" else "length"
        content = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return completion_body(self.model_name, content, reason, len(prompt), len(generation.token_ids))
