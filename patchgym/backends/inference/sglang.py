"""SGLang inference backend: an async client for SGLang's native HTTP API.

Token in, token out: `/generate` with `input_ids` and `return_logprob`, reading the sampled
tokens and their log-probs from `meta_info.output_token_logprobs`. Several engine URLs are
balanced by least outstanding requests, or generation goes through an SGLang router
(`router_url`) while control calls (pause, abort, weight updates) go to each engine directly:
the router does not forward them. Weights are updated
from a directory (`/update_weights_from_disk`), from tensors (`/update_weights_from_tensor`,
shared memory, same host) or over a process group (`/update_weights_from_distributed`, the
trainer is rank 0; see `DistributedWeights`), in buckets of at most `weight_bucket_bytes`: one
call per bucket, all inside one begin/end weight-update session; the group holds the trainer
(rank 0) and every rank of every engine (`ranks_per_engine`, tp * pp each), each engine at its
cumulative rank offset. A staged sync's groups (`StagedWeights`) stay joined after it: the next
sync with the same group names reuses them, one with other names has the old ones destroyed
first, and a failed sync destroys them. Servers started by patchgym (`patchgym.launch.engines`) belong to the
engine through `supervisor`: `start()` waits for them, `aclose()` stops them. Routes and fields follow sglang 0.5.23
(`sglang/srt/entrypoints/http_server.py`, `sglang/srt/managers/io_struct.py`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import itertools
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from patchgym.core.errors import ConfigError, EngineError, InfraError, TransportError
from patchgym.core.inference import FinishReason, Generation, SamplingParams

PauseMode = Literal["abort", "retract", "in_place"]


class WeightUpdateError(EngineError):
    """An engine refused or failed a weight update."""

    kind = "weight_update"
    retryable = False


@dataclass(frozen=True)
class DistributedWeights:
    """Weights to broadcast over a process group, the trainer being rank 0.

    `tensors` maps parameter names (the Hugging Face names the engine loads) to tensors on
    the trainer's device. The group uses gloo for CPU tensors and NCCL for CUDA tensors unless
    `backend` says otherwise. `master_address`/`master_port` is where the trainer listens.
    """

    tensors: Mapping[str, Any]
    master_address: str = "127.0.0.1"
    master_port: int = 29555
    backend: str | None = None
    group_name: str = "patchgym_weight_update"
    timeout_s: float = 300.0


@dataclass(frozen=True)
class WeightGroup:
    """One weight-update group a trainer rank hosts (rank 0) and every engine rank joins."""

    name: str
    master_address: str
    master_port: int
    tensors: Sequence[tuple[str, str, Sequence[int]]]
    """(name, dtype, shape) of every tensor the group carries, in sending order."""
    buckets: Sequence[Sequence[str]]
    """The names again, cut into the buckets the sender broadcasts one after another."""


@dataclass(frozen=True)
class StagedWeights:
    """Weights sent by trainer ranks in other processes: one group per pipeline stage.

    `send()` starts the trainer side (each stage's rank joins its group and broadcasts its
    buckets) and returns when it is done; the engines are told what to receive, group by
    group and bucket by bucket, in the same order.
    """

    groups: Sequence[WeightGroup]
    send: Callable[[], Awaitable[None]]
    backend: str = "gloo"


def _weight_version(value: Any) -> int:
    """SGLang keeps `weight_version` as a string ("default" before any update)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class SGLangEngine:
    """An `InferenceEngine` backed by one or more SGLang servers, optionally behind a router."""

    out_of_process = True
    """Weights reach it over HTTP, a process group or disk, never by sharing this process's tensors."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_context: int,
        concurrency: int = 64,
        control_connections: int = 4,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        weight_update_timeout_s: float = 600.0,
        weight_bucket_bytes: int = 512 << 20,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        pause_mode: PauseMode = "retract",
        ignore_eos: bool = False,
        router_url: str | None = None,
        ranks_per_engine: Sequence[int] | None = None,
        supervisor: Any = None,
        start_timeout_s: float = 600.0,
        launch: Mapping[str, Any] | None = None,
        router: Mapping[str, Any] | None = None,
    ) -> None:
        """`concurrency` sizes the generate connection pool (set it to the rollout concurrency);
        `weight_bucket_bytes` caps the tensors one `/update_weights_from_distributed` call
        receives (the engine's receive buffers); `ignore_eos` generates to max_new_tokens or
        the context cap (benchmarks, tests). `router_url`: generate through this SGLang router;
        `router`: its policy and flags, reported in `settings()`;
        `ranks_per_engine`: each server's tp * pp (asked from the servers when not given);
        `supervisor`: the `patchgym.launch.processes.Supervisor` of servers this engine started.
        Servers need `--context-length` at least `max_context + 6` (sglang_launch does this)."""
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ConfigError("the sglang backend needs at least one engine URL (urls=...)")
        if min(max_context, concurrency, control_connections, weight_bucket_bytes) <= 0 or retries < 0:
            raise ConfigError(
                "max_context, concurrency, control_connections and weight_bucket_bytes must be > 0 and retries >= 0"
            )
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"pause_mode must be abort, retract or in_place, not {pause_mode!r}")
        self.urls = [u.rstrip("/") for u in url_list]
        self.router_url = router_url.rstrip("/") if router_url else None
        if ranks_per_engine is not None and len(ranks_per_engine) != len(self.urls):
            raise ConfigError(f"ranks_per_engine has {len(ranks_per_engine)} entries for {len(self.urls)} engines")
        self.ranks_per_engine = list(ranks_per_engine) if ranks_per_engine is not None else None
        self.supervisor = supervisor
        self.start_timeout_s = start_timeout_s
        self.launch = dict(launch) if launch is not None else None
        self.router = dict(router) if router is not None else None
        self.max_context = max_context
        self.concurrency = concurrency
        self.control_connections = control_connections
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.weight_bucket_bytes = weight_bucket_bytes
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.pause_mode = pause_mode
        self.ignore_eos = ignore_eos
        # Generations get their own pool, sized to the rollout concurrency; control calls
        # (pause, abort, weight updates) get another, so they are never stuck behind them.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )
        self._control = httpx.AsyncClient(
            timeout=httpx.Timeout(weight_update_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=control_connections),
        )
        self._outstanding = dict.fromkeys([self.router_url] if self.router_url else self.urls, 0)
        self._turn = itertools.count()
        self._rid_url: dict[str, str] = {}
        self._version = 0
        self._weight_groups: list[str] = []
        """The staged weight groups every engine has joined, kept for the next sync."""

    def settings(self) -> dict[str, Any]:
        """Every limit this client applies."""
        return {
            "urls": list(self.urls),
            "router_url": self.router_url,
            "router": self.router,
            "ranks_per_engine": self.ranks_per_engine,
            "launch": self.launch,
            "max_context": self.max_context,
            "concurrency": self.concurrency,
            "control_connections": self.control_connections,
            "request_timeout_s": self.request_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "weight_update_timeout_s": self.weight_update_timeout_s,
            "weight_bucket_bytes": self.weight_bucket_bytes,
            "retries": self.retries,
            "retry_backoff_s": self.retry_backoff_s,
            "pause_mode": self.pause_mode,
            "ignore_eos": self.ignore_eos,
        }

    @property
    def outstanding(self) -> dict[str, int]:
        """In-flight generate requests per engine URL."""
        return dict(self._outstanding)

    # -- HTTP ------------------------------------------------------------------------------
    async def _request(
        self, client: httpx.AsyncClient, method: str, url: str, *, json: Any = None, retry: bool = True
    ) -> httpx.Response:
        """One call; transport faults and 5xx are retried, then raised as `TransportError`."""
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                response = await client.request(method, url, json=json)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 500:
                    return response
                problem = f"HTTP {response.status_code}: {response.text[:300]}"
            if attempt + 1 < attempts:
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise TransportError(f"SGLang {method} {url} failed after {attempts} attempt(s): {problem}")

    @staticmethod
    def _check(response: httpx.Response, what: str) -> Any:
        """The JSON body; a refusal is a `WeightUpdateError` for weight routes, else `EngineError`."""
        if response.status_code >= 400:
            error = WeightUpdateError if "weight" in what else EngineError
            raise error(f"SGLang {what} was refused (HTTP {response.status_code}): {response.text[:500]}")
        return response.json() if response.content else None

    async def _all(self, method: str, path: str, *, json: Any = None, what: str = "", retry: bool = True) -> list[Any]:
        """The same control call on every engine, concurrently; a server that died is named."""
        try:
            responses = await asyncio.gather(
                *(self._request(self._control, method, u + path, json=json, retry=retry) for u in self.urls)
            )
        except TransportError:
            self.check_engines()  # a dead server is the cause: say which, not a connection error
            raise
        return [self._check(r, what or path) for r in responses]

    # -- generation ------------------------------------------------------------------------
    def _pick(self) -> str:
        if self.router_url:
            return self.router_url
        live = [u for u in self.urls if u not in self.dead_urls()] or self.urls
        least = min(self._outstanding[u] for u in live)
        candidates = [u for u in live if self._outstanding[u] == least]
        return candidates[next(self._turn) % len(candidates)]

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> Generation:
        """Continue `input_ids`; `request_id` lets `abort(request_id)` cancel it."""
        budget = self.max_context - len(input_ids)
        if budget <= 0:
            return Generation((), (), "context", self._version, {"prompt_tokens": float(len(input_ids))})
        max_new = min(params.max_new_tokens, budget)
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        if self.ignore_eos:
            if params.stop_token_ids:
                raise ConfigError("ignore_eos=True makes SGLang ignore stop_token_ids too; drop one of them")
            sampling["ignore_eos"] = True
        rid = request_id or uuid.uuid4().hex
        body = {"input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True, "rid": rid}
        url = self._pick()
        self._outstanding[url] += 1
        self._rid_url[rid] = url
        try:
            response = await self._request(self._client, "POST", url + "/generate", json=body)
        except asyncio.CancelledError:
            with contextlib.suppress(InfraError):  # the engine may be gone: the cancellation still stands
                await asyncio.shield(self.abort(rid))
            raise
        finally:
            self._outstanding[url] -= 1
            self._rid_url.pop(rid, None)
        if response.status_code >= 400:
            raise ConfigError(
                f"SGLang rejected the generate request (HTTP {response.status_code}): {response.text[:500]}"
            )
        return self._parse(response.json(), max_new, params.max_new_tokens)

    def _parse(self, out: Mapping[str, Any], max_new: int, asked: int) -> Generation:
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        token_ids = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
        if token_ids != list(out.get("output_ids", token_ids)):
            raise TransportError("SGLang returned output_ids that disagree with output_token_logprobs")
        finish = (meta.get("finish_reason") or {}).get("type")
        reason: FinishReason
        if finish == "abort":
            reason = "abort"
        elif finish == "length":
            reason = "context" if max_new < asked and len(token_ids) >= max_new else "length"
        elif finish == "stop":
            reason = "stop"
        else:
            raise TransportError(f"SGLang returned an unknown finish_reason {meta.get('finish_reason')!r}")
        version = _weight_version(meta.get("weight_version"))
        metrics = {
            k: float(meta[k])
            for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency")
            if isinstance(meta.get(k), int | float)
        }
        return Generation(token_ids, logprobs, reason, version, metrics)

    async def _abort_on(self, url: str, rid: str) -> None:
        response = await self._request(self._control, "POST", url + "/abort_request", json={"rid": rid})
        self._check(response, "abort_request")

    async def abort(self, request_id: str) -> None:
        """Abort one in-flight request; its `generate` returns finish_reason "abort".

        Behind a router the request may be on any engine (the router does not forward aborts)."""
        url = self._rid_url.get(request_id)
        targets = [url] if url and url != self.router_url else [u for u in self.urls if u not in self.dead_urls()]
        for target in targets:
            await self._abort_on(target, request_id)

    async def abort_all(self) -> None:
        await self._all("POST", "/abort_request", json={"rid": "", "abort_all": True})

    # -- control ---------------------------------------------------------------------------
    async def pause(self) -> None:
        await self._all("POST", "/pause_generation", json={"mode": self.pause_mode})

    async def resume(self) -> None:
        await self._all("POST", "/continue_generation", json={})

    async def flush_cache(self) -> bool:
        """Drop the prefix caches; False if an engine is busy (SGLang refuses while requests run)."""
        responses = await asyncio.gather(*(self._request(self._control, "POST", u + "/flush_cache") for u in self.urls))
        return all(r.status_code == 200 for r in responses)

    async def health(self) -> dict[str, bool]:
        """Whether each engine answers `/health` (a one-token generation) with 200."""

        async def one(url: str) -> bool:
            try:
                return (await self._control.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                return False

        return dict(zip(self.urls, await asyncio.gather(*(one(u) for u in self.urls)), strict=True))

    async def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
        """Wait until every engine is healthy, or raise `TransportError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            state = await self.health()
            if all(state.values()):
                return
            if loop.time() > deadline:
                down = ", ".join(u for u, ok in state.items() if not ok)
                raise TransportError(f"SGLang engines not healthy after {timeout_s:.0f} s: {down}")
            await asyncio.sleep(poll_s)

    async def model_info(self) -> list[dict[str, Any]]:
        return await self._all("GET", "/model_info")

    # -- servers this engine started ---------------------------------------------------------
    def _child(self, url: str) -> Any:
        """The server process of `url` (`sglang-engine-<index>`), if this engine started it."""
        name = f"sglang-engine-{self.urls.index(url)}"
        children = self.supervisor.children if self.supervisor is not None else []
        return next((c for c in children if c.name == name), None)

    def dead_urls(self) -> set[str]:
        """Engines this client started whose server process has exited."""
        dead = self.supervisor.dead() if self.supervisor is not None else []
        return {u for u in self.urls if self._child(u) in dead}

    @property
    def settle_s(self) -> float:
        """How long an engine's death may take to show after a request failed (its supervisor's)."""
        return float(getattr(self.supervisor, "settle_s", 0.0))

    def fatal(self) -> str | None:
        """Why generation cannot go on (the router or every engine died), or None."""
        dead = self.supervisor.dead() if self.supervisor is not None else []
        router = [c for c in dead if c.name == "sglang-router"]
        if router:
            return router[0].describe()
        if dead and len(self.dead_urls()) == len(self.urls):
            return f"every SGLang engine exited; the first: {dead[0].describe()}"
        return None

    def check_engines(self) -> None:
        """Raise `ProcessDiedError` if a server this engine started has exited."""
        if self.supervisor is not None:
            self.supervisor.check()

    async def start(self) -> None:
        """Wait until every server (and the router) this engine started answers; fail fast if one exits."""
        if self.supervisor is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        targets = [*self.urls, *([self.router_url] if self.router_url else [])]
        while True:
            self.check_engines()
            state = await asyncio.gather(*(self._answers(u) for u in targets))
            if all(state):
                return
            if loop.time() > deadline:
                down = ", ".join(u for u, ok in zip(targets, state, strict=True) if not ok)
                raise TransportError(f"SGLang not ready after {self.start_timeout_s:.0f} s: {down}")
            await asyncio.sleep(1.0)

    async def _answers(self, url: str) -> bool:
        """A server answers /health; the router has registered every engine (it checks them itself)."""
        try:
            if url != self.router_url:
                return (await self._control.get(url + "/health")).status_code == 200
            response = await self._control.get(url + "/workers")
            return response.status_code == 200 and response.json().get("total") == len(self.urls)
        except (httpx.HTTPError, ValueError):
            return False

    async def weight_versions(self) -> list[int]:
        """The weight version each engine reports (`/model_info`)."""
        return [_weight_version(info.get("weight_version")) for info in await self.model_info()]

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> list[list[float]]:
        """Each engine's log-prob of each token of `input_ids` after the ones before (entry 0: 0.0), temperature 1."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        rows = []
        for out in await self._all("POST", "/generate", json=body, what="probe generate"):
            entries = out["meta_info"]["input_token_logprobs"]
            rows.append([0.0 if e[0] is None else float(e[0]) for e in entries])
        return rows

    async def engine_ranks(self) -> list[int]:
        """Each engine's tp * pp: given at start, else asked from `/server_info`."""
        if self.ranks_per_engine is None:
            infos = await self._all("GET", "/server_info")
            self.ranks_per_engine = [int(i.get("tp_size", 1)) * int(i.get("pp_size", 1)) for i in infos]
        return self.ranks_per_engine

    # -- weights ---------------------------------------------------------------------------
    async def update_weights(self, weights: Any, *, version: int) -> None:
        """Load new weights: a directory (str/Path), a name->tensor mapping, or `DistributedWeights`."""
        if isinstance(weights, str | Path):
            await self._update_from_disk(str(weights), version)
        elif isinstance(weights, DistributedWeights):
            await self._update_distributed(weights, version)
        elif isinstance(weights, StagedWeights):
            await self._update_staged(weights, version)
        elif isinstance(weights, Mapping):
            await self._update_from_tensors(weights, version)
        else:
            raise ConfigError(
                f"cannot update SGLang weights from {type(weights).__name__}: give a checkpoint directory, "
                "a name->tensor mapping or DistributedWeights"
            )
        self._version = version

    async def _update_from_disk(self, path: str, version: int) -> None:
        body = {"model_path": path, "weight_version": str(version), "flush_cache": True}
        await self._all("POST", "/update_weights_from_disk", json=body, what="update_weights_from_disk")

    async def _update_from_tensors(self, tensors: Mapping[str, Any], version: int) -> None:
        """Shared-memory handles of the tensors: the engines must run on this host."""
        from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers tensor reductions

        import torch.multiprocessing

        # The default file-descriptor strategy needs a live connection to the receiver, which
        # an HTTP body is not; file-system names survive the trip.
        torch.multiprocessing.set_sharing_strategy("file_system")
        # `named` keeps the shared tensors alive until every engine has copied them (the calls below).
        named = [(name, tensor.detach().contiguous()) for name, tensor in tensors.items()]
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(named)
        payload = base64.b64encode(buffer.getvalue()).decode()
        body = {"serialized_named_tensors": [payload], "weight_version": str(version), "flush_cache": True}
        await self._all("POST", "/begin_weight_update", json={}, what="begin_weight_update")
        try:
            await self._all("POST", "/update_weights_from_tensor", json=body, what="update_weights_from_tensor")
        finally:
            await self._all("POST", "/end_weight_update", json={}, what="end_weight_update")

    async def _update_distributed(self, weights: DistributedWeights, version: int) -> None:
        from patchgym.backends.inference.weight_group import WeightBroadcaster, split_buckets

        tensors = {name: t.detach().contiguous() for name, t in weights.tensors.items()}
        if not tensors:
            raise ConfigError("DistributedWeights holds no tensors to broadcast")
        buckets = split_buckets({n: t.numel() * t.element_size() for n, t in tensors.items()}, self.weight_bucket_bytes)
        backend = weights.backend or ("nccl" if any(t.is_cuda for t in tensors.values()) else "gloo")
        world_size, offsets = await self._group_offsets()
        broadcaster = WeightBroadcaster(
            weights.master_address, weights.master_port, world_size, backend, weights.group_name, weights.timeout_s
        )
        port = await asyncio.to_thread(broadcaster.bind)  # held from here: port 0 picks a free one
        init = [
            {
                "master_address": weights.master_address,
                "master_port": port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": weights.group_name,
                "backend": backend,
            }
            for offset in offsets
        ]
        calls = [
            self._request(self._control, "POST", u + "/init_weights_update_group", json=b, retry=False)
            for u, b in zip(self.urls, init, strict=True)
        ]
        joining = asyncio.ensure_future(asyncio.to_thread(broadcaster.join))
        # Engines answer once the group has formed, or at once if they refuse; a refusal leaves
        # our rendezvous to time out in its thread (after `timeout_s`), so it is not awaited.
        joining.add_done_callback(lambda task: task.cancelled() or task.exception())
        for response in await asyncio.gather(*calls):
            self._check(response, "init_weights_update_group")
        await joining
        try:
            await self._all("POST", "/begin_weight_update", json={}, what="begin_weight_update")
            try:
                for i, names in enumerate(buckets):
                    last = i == len(buckets) - 1  # the version and cache flush come with the complete weights
                    bucket = {name: tensors[name] for name in names}
                    await self._send_bucket(broadcaster, weights.group_name, bucket, version if last else None)
            finally:
                await self._all("POST", "/end_weight_update", json={}, what="end_weight_update")
        finally:
            await self._all("POST", "/destroy_weights_update_group", json={"group_name": weights.group_name})
            broadcaster.close()

    async def _group_offsets(self) -> tuple[int, list[int]]:
        """The group's world size (every engine rank plus the trainer) and each engine's first rank."""
        ranks = await self.engine_ranks()
        return sum(ranks) + 1, list(itertools.accumulate(ranks, initial=1))[:-1]

    async def _update_staged(self, weights: StagedWeights, version: int) -> None:
        """Every engine joins each stage's group it has not joined yet, then receives each group's
        buckets in order; the groups stay joined for the next sync."""
        names = [group.name for group in weights.groups]
        if any(name not in names for name in self._weight_groups):  # the sync formed new groups
            await self._leave_weight_groups()
        world_size, offsets = await self._group_offsets()
        sending = asyncio.ensure_future(weights.send())
        # The senders are in other processes and bounded by their own group timeouts; a refusal
        # here is raised at once, without waiting for them.
        sending.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            for group in weights.groups:
                if group.name in self._weight_groups:
                    continue
                calls = [
                    self._request(
                        self._control,
                        "POST",
                        url + "/init_weights_update_group",
                        json={
                            "master_address": group.master_address,
                            "master_port": group.master_port,
                            "rank_offset": offset,
                            "world_size": world_size,
                            "group_name": group.name,
                            "backend": weights.backend,
                        },
                        retry=False,
                    )
                    for url, offset in zip(self.urls, offsets, strict=True)
                ]
                self._weight_groups.append(group.name)  # possibly joined by some: left on failure
                for response in await asyncio.gather(*calls):
                    self._check(response, "init_weights_update_group")
            await self._all("POST", "/begin_weight_update", json={}, what="begin_weight_update")
            try:
                last = (len(weights.groups) - 1, len(weights.groups[-1].buckets) - 1)
                for g, group in enumerate(weights.groups):
                    meta = {name: (dtype, shape) for name, dtype, shape in group.tensors}
                    for b, names in enumerate(group.buckets):
                        body: dict[str, Any] = {
                            "names": list(names),
                            "dtypes": [meta[n][0] for n in names],
                            "shapes": [list(meta[n][1]) for n in names],
                            "group_name": group.name,
                            "flush_cache": (g, b) == last,
                        }
                        if (g, b) == last:  # the version and cache flush come with the complete weights
                            body["weight_version"] = str(version)
                        await self._all(
                            "POST", "/update_weights_from_distributed", json=body, what="weight update", retry=False
                        )
            finally:
                await self._all("POST", "/end_weight_update", json={}, what="end_weight_update")
            await sending
        except BaseException:
            with contextlib.suppress(InfraError, ConfigError):
                await self._leave_weight_groups()
            raise

    async def _leave_weight_groups(self) -> None:
        """Every engine destroys the staged groups it holds."""
        names, self._weight_groups = self._weight_groups, []
        for name in names:
            await self._all("POST", "/destroy_weights_update_group", json={"group_name": name})

    async def _send_bucket(
        self, broadcaster: Any, group_name: str, bucket: Mapping[str, Any], version: int | None
    ) -> None:
        """Tell every engine one bucket's names, dtypes and shapes, then broadcast its tensors."""
        body: dict[str, Any] = {
            "names": list(bucket),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()],
            "group_name": group_name,
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = str(version)
        update = asyncio.gather(
            *(
                self._request(self._control, "POST", u + "/update_weights_from_distributed", json=body, retry=False)
                for u in self.urls
            )
        )
        await asyncio.to_thread(broadcaster.broadcast, list(bucket.values()))
        await asyncio.to_thread(broadcaster.wait)
        for response in await update:
            self._check(response, "update_weights_from_distributed")

    async def aclose(self) -> None:
        """Leave the weight groups, close the connections and stop the servers this engine started."""
        try:
            with contextlib.suppress(InfraError, ConfigError):
                await self._leave_weight_groups()
            await self._client.aclose()
            await self._control.aclose()
        finally:
            if self.supervisor is not None:
                await asyncio.to_thread(self.supervisor.stop)
