"""The embedded inference engine: a transformers model in this process, with continuous batching.

All `generate` calls share one batch and one KV cache. A scheduler thread runs the model (the
event loop never waits on it): each iteration it admits waiting requests (one batched prefill,
then they join the running batch), runs one decode step for every running request, samples,
and retires finished requests. A request arriving while others decode joins at the next step.

Log-probs are those of the sampled token under the temperature-scaled distribution
(`log_softmax(logits / temperature)`, before top-p truncation; temperature 0 means greedy and
reports `log_softmax(logits)`). At temperature 1 they equal a teacher-forced forward pass.

`update_weights` applies between two steps; pause first (as the rollout loop does) so that no
request mixes old and new weights. Every limit is a constructor setting, reported by `settings()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from patchgym.backends.device import resolve_device
from patchgym.core.errors import ConfigError, EngineError
from patchgym.core.inference import FinishReason, Generation, SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(eq=False)
class _Request:
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    generator: torch.Generator | None
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False

    def finish(self, reason: FinishReason, version: int) -> None:
        now = time.perf_counter()
        generation = Generation(
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            finish_reason=reason,
            weight_version=version,
            metrics={"queue_s": (self.admitted or now) - self.submitted, "latency_s": now - self.submitted},
        )
        self._deliver(generation, None)

    def fail(self, error: BaseException) -> None:
        self._deliver(None, error)

    def _deliver(self, result: Generation | None, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits for this answer
            self.loop.call_soon_threadsafe(_resolve, self.future, result, error)


def _resolve(future: asyncio.Future[Generation], result: Generation | None, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def validate_params(params: SamplingParams) -> None:
    """Raise `ConfigError` for sampling settings no engine can honour."""
    if params.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {params.top_p}")


class _Batch:
    """The running requests and their shared, left-padded KV cache."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.requests: list[_Request] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [B, L]: 1 where the cache holds a real token
        self.next_token = torch.zeros(0, dtype=torch.long)  # [B]: sampled, not yet in the cache
        self.position = torch.zeros(0, dtype=torch.long)  # [B]: position id of next_token

    def __len__(self) -> int:
        return len(self.requests)

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cache is not None
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def join(self, other: _Batch) -> None:
        """Add `other`'s requests, left-padding both caches to a common length."""
        if not other.requests:
            return
        if not self.requests:
            self.requests, self.cache, self.mask = other.requests, other.cache, other.mask
            self.next_token, self.position = other.next_token, other.position
            return
        length = max(self.mask.shape[1], other.mask.shape[1])
        layers = [
            (
                torch.cat([_left_pad(k1, length, dim=2), _left_pad(k2, length, dim=2)]),
                torch.cat([_left_pad(v1, length, dim=2), _left_pad(v2, length, dim=2)]),
            )
            for (k1, v1), (k2, v2) in zip(self._kv(), other._kv(), strict=True)
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = torch.cat([_left_pad(self.mask, length, dim=1), _left_pad(other.mask, length, dim=1)])
        self.requests += other.requests
        self.next_token = torch.cat([self.next_token, other.next_token])
        self.position = torch.cat([self.position, other.position])

    def keep(self, keep: list[int]) -> None:
        """Retain the rows `keep` and drop cache columns that are padding in every remaining row."""
        if len(keep) == len(self.requests):
            return
        self.requests = [self.requests[i] for i in keep]
        if not keep:
            self.clear()
            return
        rows = torch.tensor(keep)
        self.mask, self.next_token, self.position = self.mask[rows], self.next_token[rows], self.position[rows]
        start = int((self.mask.cumsum(dim=1) == 0).sum(dim=1).min())
        self.cache = DynamicCache(ddp_cache_data=[(k[rows, :, start:], v[rows, :, start:]) for k, v in self._kv()])
        self.mask = self.mask[:, start:]


def _left_pad(tensor: torch.Tensor, length: int, *, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class EmbeddedEngine:
    """An `InferenceEngine` running a transformers causal LM in-process with continuous batching."""

    def __init__(
        self,
        model: str | Path | PreTrainedModel,
        *,
        max_context: int = 4096,
        max_batch_size: int = 32,
        device: str = "auto",
        dtype: str = "float32",
        seed: int = 0,
        weight_version: int = 0,
        stop_at_eos: bool = True,
    ) -> None:
        """`model`: a folder, or a loaded model (used as is, not copied).

        Args:
            model: the policy's Hugging Face folder (the pipeline passes model.path or the tiny model)
            max_context: longest sequence (prompt and generated tokens) a request may reach
            max_batch_size: requests decoded together in one forward pass (continuous batching)
            device: cpu, cuda, cuda:N, rocm, rocm:N, or auto (the first GPU torch sees, else the CPU)
            dtype: weights and compute: float32, bfloat16 or float16
            seed: seed of sampling for requests that bring no seed of their own
            weight_version: the policy version the loaded weights are (a sync raises it)
            stop_at_eos: also stop every request at the model's EOS tokens (generation_config), as
                SGLang and `generate` do
        """
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        if max_batch_size < 1 or max_context < 2:
            raise ConfigError("max_batch_size must be >= 1 and max_context >= 2")
        if isinstance(model, PreTrainedModel):
            self.model = model
            self._model_source = type(model).__name__
        else:
            if not (Path(model) / "config.json").is_file():
                raise ConfigError(f"{model} is not a Hugging Face model folder (no config.json)")
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=_DTYPES[dtype])
            self._model_source = str(model)
        target = resolve_device(device)
        self.model = self.model.to(device=target, dtype=_DTYPES[dtype]).eval()
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions is not None and max_context > positions:
            raise ConfigError(f"max_context {max_context} exceeds the model's max_position_embeddings {positions}")
        self.max_context = max_context
        self.max_batch_size = max_batch_size
        self.device = target
        self.dtype = dtype
        self.vocab_size = int(self.model.config.vocab_size)
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"  # renamed in transformers 5.x
        self.weight_version = weight_version
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._seed = seed
        self.eos_token_ids = _eos_ids(self.model) if stop_at_eos else frozenset()
        self._waiting: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._paused = False
        self._closed = False
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="patchgym-embedded-engine", daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Every limit and choice of this engine."""
        return {
            "model": self._model_source,
            "max_context": self.max_context,
            "max_batch_size": self.max_batch_size,
            "device": str(self.device),
            "dtype": self.dtype,
            "seed": self._seed,
            "stop_at_eos_ids": sorted(self.eos_token_ids),
            "torch_threads": torch.get_num_threads(),
        }

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self._closed:
            raise EngineError("the embedded engine is closed", retryable=False)
        validate_params(params)
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ConfigError("input_ids is empty: the prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the model's vocabulary (0..{self.vocab_size - 1})")
        if len(ids) >= self.max_context:
            return Generation([], [], "context", self.weight_version, {"queue_s": 0.0, "latency_s": 0.0})
        loop = asyncio.get_running_loop()
        generator = None if params.seed is None else torch.Generator(device="cpu").manual_seed(params.seed)
        request = _Request(ids, params, loop, loop.create_future(), generator)
        self._waiting.put(request)
        self._wake.set()
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            request.cancelled = True
            self._wake.set()
            raise

    async def update_weights(self, weights: Any, *, version: int) -> None:
        """Load a state dict (name -> tensor) or a folder of `*.safetensors` files; set `version`."""
        if isinstance(weights, str | Path):
            state = await asyncio.to_thread(_load_folder, Path(weights))
        elif isinstance(weights, Mapping):
            state = weights
        else:
            raise ConfigError(f"weights must be a state dict or a folder path, got {type(weights).__name__}")

        def load() -> None:
            _copy_weights(self.model, state)
            self.weight_version = version

        await self._command(load)

    async def pause(self) -> None:
        """Return once no step runs and none will start until `resume()`."""
        self._paused = True
        await self._command(lambda: None)

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def aclose(self) -> None:
        """Stop the scheduler; unfinished requests end with finish_reason "abort"."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)

    # -- scheduler thread --------------------------------------------------------------
    async def _command(self, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise EngineError("the embedded engine is closed", retryable=False)
        done: Future[Any] = Future()
        self._commands.put((fn, done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def _run(self) -> None:
        batch = _Batch()
        try:
            while not self._closed:
                self._run_commands()
                if self._paused:
                    self._sleep()
                    continue
                self._admit(batch)
                if not batch:
                    self._sleep()
                    continue
                self._decode(batch)
        except Exception as exc:  # a model fault: every caller learns it, none hangs
            error = EngineError(f"the embedded engine failed: {type(exc).__name__}: {exc}", retryable=False)
            self._closed = True
            for request in batch.requests + self._drain():
                request.fail(error)
            self._fail_commands(error)
            return
        for request in batch.requests + self._drain():
            request.finish("abort", self.weight_version)
        self._fail_commands(EngineError("the embedded engine is closed", retryable=False))

    def _sleep(self) -> None:
        self._wake.wait(timeout=1.0)
        self._wake.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                with torch.no_grad():
                    done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)

    def _fail_commands(self, error: Exception) -> None:
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            done.set_exception(error)

    def _drain(self) -> list[_Request]:
        drained = []
        while True:
            try:
                drained.append(self._waiting.get_nowait())
            except queue.Empty:
                return drained

    @torch.no_grad()
    def _admit(self, batch: _Batch) -> None:
        room = self.max_batch_size - len(batch)
        new: list[_Request] = []
        while len(new) < room:
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                break
            if request.cancelled:
                request.finish("abort", self.weight_version)
            else:
                new.append(request)
        if not new:
            return
        now = time.perf_counter()
        for request in new:
            request.admitted = now
        length = max(len(r.input_ids) for r in new)
        ids = torch.tensor([[0] * (length - len(r.input_ids)) + r.input_ids for r in new], device=self.device)
        mask = torch.tensor([[0] * (length - len(r.input_ids)) + [1] * len(r.input_ids) for r in new])
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids,
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
            **{self._cache_arg: cache},
            logits_to_keep=1,
        ).logits[:, -1, :]
        joining = _Batch()
        joining.requests, joining.cache, joining.mask = new, cache, mask
        joining.position = torch.tensor([len(r.input_ids) for r in new])
        joining.next_token = self._sample(new, logits)
        self._retire(joining)
        batch.join(joining)

    @torch.no_grad()
    def _decode(self, batch: _Batch) -> None:
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
        logits = self.model(
            input_ids=batch.next_token[:, None].to(self.device),
            attention_mask=batch.mask.to(self.device),
            position_ids=batch.position[:, None].to(self.device),
            use_cache=True,
            **{self._cache_arg: batch.cache},
        ).logits[:, -1, :]
        batch.position = batch.position + 1
        batch.next_token = self._sample(batch.requests, logits)
        self._steps += 1
        self._retire(batch)

    def _retire(self, batch: _Batch) -> None:
        keep = []
        for row, request in enumerate(batch.requests):
            reason = self._finish_reason(request)
            if request.cancelled:
                request.finish("abort", self.weight_version)
            elif reason is not None:
                request.finish(reason, self.weight_version)
            else:
                keep.append(row)
        batch.keep(keep)

    def _finish_reason(self, request: _Request) -> FinishReason | None:
        if request.tokens[-1] in request.params.stop_token_ids or request.tokens[-1] in self.eos_token_ids:
            return "stop"
        if len(request.tokens) >= request.params.max_new_tokens:
            return "length"
        if len(request.input_ids) + len(request.tokens) >= self.max_context:
            return "context"
        return None

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        """Pick one token per row; record it and its log-prob on the request."""
        logits = logits.float().cpu()
        temperature = torch.tensor([r.params.temperature or 1.0 for r in requests])[:, None]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        chosen = logprobs.argmax(dim=-1)
        for row, request in enumerate(requests):
            if request.params.temperature == 0:
                continue
            probs = logprobs[row].exp()
            if request.params.top_p < 1:
                probs = _top_p(probs, request.params.top_p)
            chosen[row] = torch.multinomial(probs, 1, generator=request.generator or self._generator)[0]
        picked = logprobs.gather(1, chosen[:, None])[:, 0]
        for request, token, logprob in zip(requests, chosen.tolist(), picked.tolist(), strict=True):
            request.tokens.append(token)
            request.logprobs.append(logprob)
        return chosen


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose probability reaches `top_p`."""
    ordered, order = probs.sort(descending=True)
    outside = ordered.cumsum(0) - ordered >= top_p
    ordered[outside] = 0.0
    return torch.zeros_like(probs).scatter(0, order, ordered)


def _eos_ids(model: PreTrainedModel) -> frozenset[int]:
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def _copy_weights(model: PreTrainedModel, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` into `model` in place after checking names and shapes (tied weights may be absent)."""
    own = model.state_dict()
    tied = set(model._tied_weights_keys or ()) if model.config.tie_word_embeddings else set()
    missing = sorted(set(own) - set(state) - tied)
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(k for k in set(state) & set(own) if tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or wrong_shape:
        raise ConfigError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {wrong_shape[:5]}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {folder}: save the weights with save_pretrained")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state
