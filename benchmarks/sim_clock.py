"""Discrete-event simulation on asyncio: a loop whose clock jumps instead of sleeping, and an
engine model whose speed depends on how many sequences share it.

`VirtualClockLoop` runs ordinary asyncio code (the real `RolloutManager` included) in simulated
time: when nothing is ready, the clock advances to the next timer instead of waiting for it, so
a simulated hour takes milliseconds and every run is deterministic. Only `loop.time()` (and so
`asyncio.sleep`, timeouts, `call_later`) is virtual; code that reads `time.perf_counter()` sees
real time.

`SimulatedEngine` is one inference engine under processor sharing: a decode step advances every
running sequence by one token and takes `decode_base_s + decode_per_seq_s * B` for `B` sequences
in flight; a request first waits for its prefill (`prefill_per_token_s` per context token,
prefill-first scheduling as SGLang's default), then decodes. `EngineCurve.fit` derives those
three numbers from measured throughput (see benchmarks/engine_curve.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import selectors
import statistics
from collections import deque
from dataclasses import dataclass, field

_EPSILON_S = 1e-6
"""Simulated time below which work counts as done (float clocks cannot advance by less)."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; when nothing is ready, moves the clock to the next timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if not events and timeout is not None:
            self.now += timeout
        elif not events and timeout is None:
            raise RuntimeError("simulation deadlock: nothing is scheduled and nothing can become ready")
        return events


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is simulated seconds; see the module docstring."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_simulated(coro):  # noqa: ANN001, ANN201 - any coroutine, its result
    """Run `coro` to completion on a fresh `VirtualClockLoop`."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@dataclass(frozen=True)
class EngineCurve:
    """Seconds per decode step as `decode_base_s + decode_per_seq_s * B`, and prefill seconds per token."""

    decode_base_s: float
    decode_per_seq_s: float
    prefill_per_token_s: float

    def step_s(self, sequences: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * sequences

    def tokens_per_s(self, sequences: int) -> float:
        """Aggregate decode throughput with `sequences` in flight."""
        return sequences / self.step_s(sequences)

    def scaled(self, factor: float) -> EngineCurve:
        """The same curve on hardware `factor` times slower (the form kept, every term scaled)."""
        return EngineCurve(*(value * factor for value in dataclasses.astuple(self)))

    @staticmethod
    def fit(step_s_by_batch: dict[int, float], prefill_per_token_s: float) -> EngineCurve:
        """A Theil-Sen line through measured (batch size, seconds per decode step) points: the median
        of the pairwise slopes, so that one disturbed measurement does not tilt it."""
        points = sorted(step_s_by_batch.items())
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :]]
        slope = max(statistics.median(slopes), 0.0) if slopes else 0.0
        base = statistics.median(y - slope * x for x, y in points)
        return EngineCurve(max(base, 1e-9), slope, prefill_per_token_s)


@dataclass
class _Request:
    prefill_left_s: float
    tokens_left: float
    done: asyncio.Future[None] = field(repr=False)


class SimulatedEngine:
    """One engine shared by every request sent to it; see the module docstring."""

    def __init__(self, curve: EngineCurve) -> None:
        self.curve = curve
        self._prefilling: deque[_Request] = deque()
        self._decoding: list[_Request] = []
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.busy_s = 0.0

    @property
    def load(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    async def generate(self, context_tokens: int, new_tokens: int) -> None:
        """Returns once `new_tokens` have been decoded after a prefill of `context_tokens`."""
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        request = _Request(self.curve.prefill_per_token_s * context_tokens, float(new_tokens), loop.create_future())
        self._prefilling.append(request)
        self._schedule(loop)
        try:
            await request.done
        except asyncio.CancelledError:
            self._advance(loop.time())
            for queue in (self._prefilling, self._decoding):
                if request in queue:
                    queue.remove(request)
            self._schedule(loop)
            raise

    def _advance(self, now: float) -> None:
        elapsed, self._last = now - self._last, now
        if self._prefilling or self._decoding:
            self.busy_s += elapsed
        while elapsed > 0 and self._prefilling:
            head = self._prefilling[0]
            used = min(elapsed, head.prefill_left_s)
            head.prefill_left_s -= used
            elapsed -= used
            if head.prefill_left_s <= _EPSILON_S:
                self._decoding.append(self._prefilling.popleft())
        if elapsed > 0 and self._decoding:
            tokens = elapsed / self.curve.step_s(len(self._decoding))
            for request in self._decoding:
                request.tokens_left -= tokens
        finished = [r for r in self._decoding if r.tokens_left * self.curve.step_s(len(self._decoding)) <= _EPSILON_S]
        for request in finished:
            self._decoding.remove(request)
            if not request.done.done():
                request.done.set_result(None)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._prefilling:
            delay = self._prefilling[0].prefill_left_s
        elif self._decoding:
            delay = min(r.tokens_left for r in self._decoding) * self.curve.step_s(len(self._decoding))
        else:
            return
        self._timer = loop.call_later(max(delay, _EPSILON_S), self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(loop.time())
        self._schedule(loop)


class EngineGroup:
    """Engines behind a least-loaded router (the sglang-router's load balancing, simplified)."""

    def __init__(self, curve: EngineCurve, engines: int) -> None:
        self.engines = [SimulatedEngine(curve) for _ in range(engines)]

    @property
    def busy_s(self) -> float:
        """Engine-seconds spent with work in flight, summed over the engines."""
        return sum(e.busy_s for e in self.engines)

    async def generate(self, context_tokens: int, new_tokens: int) -> None:
        engine = min(self.engines, key=lambda e: e.load)
        await engine.generate(context_tokens, new_tokens)
