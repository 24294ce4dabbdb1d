"""Start, watch and stop the parts of a run (engines, trainer, sandboxes) as one unit.

`start_parts` waits for every part that has servers to come up. `watched` runs the run's body
while polling each part's `fatal()` (a process it started has died in a way the run cannot
survive: a trainer rank, the router, every engine): the body is cancelled and the run stops with
`ProcessDiedError` within about `poll_s`, wherever it was blocked. When the body fails first (a
collective whose peer died), the parts get `settle_s` (their longest `settle_s` attribute, at
least `DEFAULT_SETTLE_S`) to report the death, so the error names the dead process, whichever
part noticed first. `close_parts` closes every part even when some fail to close, so no process
is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from patchgym.launch.processes import ProcessDiedError


async def start_parts(parts: Sequence[Any]) -> None:
    """Await `start()` of every part that has one, concurrently."""
    await asyncio.gather(*(part.start() for part in parts if hasattr(part, "start")))


def _fatal(parts: Sequence[Any]) -> str | None:
    for part in parts:
        problem = part.fatal() if hasattr(part, "fatal") else None
        if problem:
            return problem
    return None


DEFAULT_SETTLE_S = 2.0
"""How long a part that has no `settle_s` of its own may take to report a death after the body failed."""


def settle_time(parts: Sequence[Any]) -> float:
    """The longest time any part needs to tell that one of its processes died (`settle_s`)."""
    return max([DEFAULT_SETTLE_S, *(float(getattr(part, "settle_s", 0.0)) for part in parts)])


async def _settled_fatal(parts: Sequence[Any], wait_s: float) -> str | None:
    """`_fatal`, giving a process that is going down (its peer saw the socket close) `wait_s` to be seen as dead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while (found := _fatal(parts)) is None and loop.time() < deadline:
        await asyncio.sleep(0.1)
    return found


async def _absorb_cancel(task: asyncio.Task) -> None:
    """Take back the watcher's cancellation of `task` when the block failed before it arrived, so
    that it cannot interrupt the run's clean-up later."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0)  # a pending cancellation is delivered here
    task.uncancel()


async def _stopped(watcher: asyncio.Task) -> None:
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher


@contextlib.asynccontextmanager
async def watched(parts: Sequence[Any], poll_s: float = 1.0) -> AsyncIterator[None]:
    """Run the block; if a part turns fatal, cancel it and raise `ProcessDiedError` instead."""
    task = asyncio.current_task()
    assert task is not None
    problem: list[str] = []

    async def watch() -> None:
        while True:
            await asyncio.sleep(poll_s)
            found = _fatal(parts)
            if found:
                problem.append(found)
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not problem:
            raise
        task.uncancel()
        raise ProcessDiedError(f"the run stopped: {problem[0]}") from None
    except Exception as exc:
        # e.g. a collective that failed because its peer died: name the dead process instead
        watcher.cancel()  # from here on only this branch looks, so the watcher cannot cancel it
        if problem:
            await _absorb_cancel(task)
        found = problem[0] if problem else await _settled_fatal(parts, settle_time(parts))
        if found:
            raise ProcessDiedError(f"the run stopped: {found}") from exc
        raise
    finally:
        await _stopped(watcher)
    if problem:  # the cancellation landed where the block swallowed it
        raise ProcessDiedError(f"the run stopped: {problem[0]}")


async def close_parts(parts: Sequence[Any]) -> None:
    """`aclose()` every part (None entries are parts never created); the first error is raised after all."""
    errors: list[BaseException] = []
    for part in parts:
        if part is None:
            continue
        try:
            await part.aclose()
        except Exception as exc:  # every part is closed before the first failure is reported
            errors.append(exc)
    if errors:
        raise errors[0]
