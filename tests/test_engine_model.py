"""The long-tail benchmark's simulation parts: the virtual clock and the shared-engine model."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from sim_clock import EngineCurve, EngineGroup, SimulatedEngine, run_simulated  # noqa: E402


def test_virtual_clock_jumps_instead_of_sleeping() -> None:
    async def main() -> float:
        await asyncio.sleep(3600)
        return asyncio.get_running_loop().time()

    assert run_simulated(main()) == pytest.approx(3600)


def test_virtual_clock_reports_a_deadlock() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="deadlock"):
        run_simulated(main())


def finish_times(curve: EngineCurve, requests: list[tuple[float, int, int]]) -> list[float]:
    """(send time, context tokens, new tokens) per request -> when each one finished."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        engine = SimulatedEngine(curve)

        async def one(at: float, context: int, new: int) -> float:
            await asyncio.sleep(at)
            await engine.generate(context, new)
            return loop.time()

        return list(await asyncio.gather(*(one(*r) for r in requests)))

    return run_simulated(main())


def test_sequences_share_decode_steps() -> None:
    curve = EngineCurve(decode_base_s=0.01, decode_per_seq_s=0.001, prefill_per_token_s=0.0)
    alone = finish_times(curve, [(0, 0, 100)])
    assert alone == pytest.approx([100 * 0.011])
    # Two at once: each step is longer (0.012 s) but serves both.
    assert finish_times(curve, [(0, 0, 100), (0, 0, 100)]) == pytest.approx([1.2, 1.2])
    # The second joins half-way through the first: the first slows down from then on.
    first, second = finish_times(curve, [(0, 0, 100), (0.55, 0, 100)])
    assert first == pytest.approx(0.55 + 50 * 0.012)
    assert second == pytest.approx(first + 50 * 0.011)


def test_prefill_runs_first_and_holds_decoding() -> None:
    curve = EngineCurve(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.001)
    # A decoding request is held while a newcomer's 500-token prefill (0.5 s) runs.
    first, second = finish_times(curve, [(0, 0, 100), (0.2, 500, 10)])
    assert first == pytest.approx(1.0 + 0.5)
    assert second == pytest.approx(0.2 + 0.5 + 10 * 0.01)


def test_fit_recovers_a_line_and_the_group_balances_load() -> None:
    curve = EngineCurve.fit({1: 0.011, 2: 0.012, 4: 0.014, 8: 0.018}, 1e-5)
    assert curve.decode_base_s == pytest.approx(0.01)
    assert curve.decode_per_seq_s == pytest.approx(0.001)
    assert curve.scaled(2).step_s(4) == pytest.approx(2 * curve.step_s(4))

    async def main() -> tuple[list[int], list[int]]:
        group = EngineGroup(curve, engines=2)
        requests = [asyncio.create_task(group.generate(0, 10)) for _ in range(4)]
        await asyncio.sleep(0)
        during = [e.load for e in group.engines]
        await asyncio.gather(*requests)
        return during, [e.load for e in group.engines]

    assert run_simulated(main()) == ([2, 2], [0, 0])


def test_cancelled_request_leaves_the_engine() -> None:
    curve = EngineCurve(decode_base_s=0.01, decode_per_seq_s=0.01, prefill_per_token_s=0.0)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        engine = SimulatedEngine(curve)
        doomed = asyncio.create_task(engine.generate(0, 1000))
        await asyncio.sleep(0.1)
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        start = loop.time()
        await engine.generate(0, 10)
        return loop.time() - start

    assert run_simulated(main()) == pytest.approx(10 * 0.02)
