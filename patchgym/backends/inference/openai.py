"""An async client for OpenAI-compatible `/v1/chat/completions` services (OpenAI, SGLang, vLLM, ...).

For text-level evaluation only: messages in, text out. Connection pool, timeouts and retries
are settings. Transport faults, 429 and 5xx are retried with exponential backoff and then raised
as `TransportError` / `CapacityError` (infrastructure, never a wrong answer); other 4xx answers
are a `ConfigError` quoting the service's message.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from patchgym.core.chat_model import ChatReply
from patchgym.core.errors import CapacityError, ConfigError, InfraError, TransportError


class OpenAIChatModel:
    """A `ChatModel` speaking the OpenAI chat-completions wire format over HTTP."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        max_tokens: int = 4096,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_connections: int = 16,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 1.0,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"model URL {base_url!r} must start with http:// or https://")
        if max_connections < 1 or max_retries < 0 or max_tokens < 1:
            raise ConfigError("max_connections and max_tokens must be >= 1, max_retries >= 0")
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else f"{root}/v1"
        self.model = model
        self.max_tokens, self.temperature, self.top_p = max_tokens, temperature, top_p
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.extra_body = dict(extra_body or {})
        key = api_key if api_key is not None else os.environ.get(api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._model_lock = asyncio.Lock()

    def settings(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_connections": self.max_connections,
            "timeout_s": self.timeout_s,
            "max_retries": self.max_retries,
            "retry_backoff_s": self.retry_backoff_s,
        }

    async def complete(self, messages: Sequence[Mapping[str, str]]) -> ChatReply:
        body = {
            **self.extra_body,
            "model": await self._model_name(),
            "messages": [dict(m) for m in messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": False,
        }
        started = time.perf_counter()
        data = await self._request("POST", "/chat/completions", json=body)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
            finish = choice.get("finish_reason") or "unknown"
        except (KeyError, IndexError, TypeError) as exc:
            raise TransportError(f"malformed chat-completions answer from {self.base_url}: {data!r:.300}") from exc
        usage = data.get("usage") or {}
        return ChatReply(
            text, finish, usage.get("prompt_tokens"), usage.get("completion_tokens"), time.perf_counter() - started
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _model_name(self) -> str:
        """The configured model, else the first one the service lists at /v1/models."""
        async with self._model_lock:
            if self.model is None:
                data = await self._request("GET", "/models")
                try:
                    self.model = str(data["data"][0]["id"])
                except (KeyError, IndexError, TypeError) as exc:
                    raise ConfigError(f"{self.base_url}/models lists no model; pass the model name") from exc
            return self.model

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        error: InfraError | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = self.retry_backoff_s * 2 ** (attempt - 1)
                if isinstance(error, CapacityError) and error.retry_after_s is not None:
                    delay = max(delay, error.retry_after_s)
                await asyncio.sleep(delay)
            try:
                response = await self._client.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error = TransportError(f"{method} {self.base_url}{path} failed: {type(exc).__name__}: {exc}")
                continue
            if response.status_code == 429:
                error = CapacityError(
                    f"{self.base_url}{path} is rate-limited (429): {_message(response)}",
                    retry_after_s=_retry_after(response),
                )
                continue
            if response.status_code >= 500:
                error = TransportError(f"{self.base_url}{path} answered {response.status_code}: {_message(response)}")
                continue
            if response.status_code >= 400:
                raise ConfigError(
                    f"{self.base_url}{path} refused the request ({response.status_code}): {_message(response)}"
                )
            try:
                return response.json()
            except ValueError as exc:
                raise TransportError(f"{self.base_url}{path} answered with non-JSON: {response.text[:200]!r}") from exc
        assert error is not None
        raise error


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return str(data["error"].get("message", data["error"]))
        return str(data)[:300]
    except ValueError:
        return response.text[:300]


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None
