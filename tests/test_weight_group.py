"""The trainer's end of the weight-update group: its join ends within its timeout, whichever
member is missing, and broadcasts after a late join still get the whole timeout; its port is held
from `bind()` on; closing waits for the broadcasts it enqueued; a stage leader keeps its group
between syncs (`SyncGroup`).

Each scenario runs in a process of its own (the rendezvous blocks in torch's C++ code, which no
thread can interrupt), with the engine ranks as its children; `run_group` kills them all when it
returns, also on a hang.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.processes import run_group

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 8.0
"""The join's timeout here: long enough that twice of it (the old worst case) stands out."""

ENGINE_RANK = """
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

port, world, rank, timeout, mode, delay = sys.argv[1:]
world, rank, timeout, delay = int(world), int(rank), timedelta(seconds=float(timeout)), float(delay)
print("ready", flush=True)  # torch is imported: what follows takes no time but the waits
time.sleep(delay)  # a late engine
store, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", rank, world, timeout=timeout))
if mode == "store-only":  # it reached the store, never the group: an engine that died in between
    time.sleep(3600)
group, _ = c10d._new_process_group_helper(
    world, rank, [], c10d.Backend("gloo"), c10d.PrefixStore("g", store), group_name="g", timeout=timeout
)
c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
time.sleep(delay)  # and late to the broadcast too
tensor = torch.zeros(4)
dist.broadcast(tensor, src=0, group=group)
print(tensor.tolist(), flush=True)
"""

TRAINER = """
import json, subprocess, sys, time
import torch
from patchgym.backends.inference.weight_group import WeightBroadcaster
from patchgym.core.errors import TransportError
from patchgym.launch.engines import free_port

timeout, engines, delay = float(sys.argv[1]), sys.argv[2].split(",") if sys.argv[2] else [], sys.argv[3]


def alone(name):  # how long a join takes that waits for no one: everything it does but waiting
    started = time.monotonic()
    solo = WeightBroadcaster("127.0.0.1", free_port(), 1, "gloo", name, timeout)
    solo.join()
    solo.close()
    return time.monotonic() - started


result = {"overhead_s": [alone("before")], "error": None, "received": None}
port, world = free_port(), len(engines) + 1
ranks = [
    subprocess.Popen([sys.executable, "-c", sys.argv[4], str(port), str(world), str(rank), str(timeout), mode, delay],
                     stdout=subprocess.PIPE, text=True)
    for rank, mode in enumerate(engines, 1)
    if mode != "absent"
]
assert all(rank.stdout.readline() == "ready\\n" for rank in ranks)
broadcaster = WeightBroadcaster("127.0.0.1", port, world, "gloo", "g", timeout)
started = time.monotonic()
try:
    broadcaster.join()
    result["join_s"] = time.monotonic() - started
    broadcaster.broadcast([torch.arange(4.0)])
    result["received"] = [rank.stdout.readline().strip() for rank in ranks]
except TransportError as exc:
    result.setdefault("join_s", time.monotonic() - started)
    result["error"] = str(exc)
finally:
    for rank in ranks:
        rank.kill()
        rank.wait()
result["overhead_s"].append(alone("after"))
print(json.dumps(result), flush=True)
"""


def rendezvous(engines: list[str], delay_s: float = 0.0) -> dict[str, Any]:
    """The trainer's join (timeout `TIMEOUT_S`) with one engine rank per mode in `engines`: `gloo`
    (joins and takes the broadcast), `store-only` (reaches the store and stops), `absent` (never runs)."""
    argv = [sys.executable, "-c", TRAINER, str(TIMEOUT_S), ",".join(engines), str(delay_s), ENGINE_RANK]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = run_group(argv, timeout_s=20 * TIMEOUT_S, env=env)  # the outer guard: a hang is killed, not waited out
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def within_timeout(result: dict[str, Any]) -> None:
    """The join gave up within its timeout plus a margin: 50 times what a join that waits for no
    one took in the same process just before and after (a busy machine slows both down; twice
    the timeout, the old worst case, stays out of reach unless such a join takes 160 ms)."""
    bound = TIMEOUT_S + 50 * max(result["overhead_s"])
    assert result["join_s"] <= bound, f"the join gave up after {result['join_s']:.1f} s, bound {bound:.1f} s"


@pytest.mark.usefixtures("train_extra")
def test_join_gives_up_within_its_timeout_when_an_engine_never_comes() -> None:
    result = rendezvous(["absent"])
    assert result["error"] and "not all 2 members joined" in result["error"], result
    within_timeout(result)


@pytest.mark.usefixtures("train_extra")
def test_join_gives_up_within_its_timeout_when_an_engine_stops_after_the_store() -> None:
    """Every engine reaches the store, one never joins the group: this waited a second whole timeout."""
    result = rendezvous(["gloo", "store-only"])
    assert result["error"] and "not all 3 members joined" in result["error"], result
    within_timeout(result)


@pytest.mark.usefixtures("train_extra")
def test_a_late_join_leaves_broadcasts_the_whole_timeout() -> None:
    """The engine comes at 60% of the timeout and broadcasts 60% later still: past what the join had
    left, within the group's timeout."""
    result = rendezvous(["gloo"], delay_s=0.6 * TIMEOUT_S)
    assert result["error"] is None, result
    assert result["received"] == ["[0.0, 1.0, 2.0, 3.0]"]


def solo(name: str, port: int = 0) -> Any:
    """A joined one-member group (gloo): the broadcaster's own work, no engine to wait for."""
    from patchgym.backends.inference.weight_group import WeightBroadcaster

    broadcaster = WeightBroadcaster("127.0.0.1", port, 1, "gloo", name, TIMEOUT_S)
    broadcaster.join()
    return broadcaster


@pytest.mark.usefixtures("train_extra")
def test_the_port_is_held_from_bind_until_close() -> None:
    """No pick-then-release: the port `bind()` reports is bound by it, so no other process can take it."""
    import socket

    from patchgym.backends.inference.weight_group import WeightBroadcaster

    broadcaster = WeightBroadcaster("127.0.0.1", 0, 2, "gloo", "held", TIMEOUT_S)
    port = broadcaster.bind()
    assert port > 0 and broadcaster.master_port == port and broadcaster.bind() == port
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    broadcaster.close()


class SlowWork:
    """A fake asynchronous broadcast (NCCL's enqueued work, which gloo cannot show): done after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        import threading

        self.done = threading.Event()
        threading.Timer(delay_s, self.done.set).start()

    def wait(self) -> bool:
        return self.done.wait(60)


@pytest.mark.usefixtures("train_extra")
def test_close_waits_for_enqueued_broadcasts(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    broadcaster = solo("async")
    works: list[SlowWork] = []
    destroyed_with: list[bool] = []
    destroy = dist.destroy_process_group

    def broadcast(tensor: Any, src: int, group: Any, async_op: bool = False) -> SlowWork:
        assert async_op, "the sender must enqueue broadcasts, not block on each"
        works.append(SlowWork(0.3))
        return works[-1]

    def destroy_process_group(group: Any = None) -> None:
        destroyed_with.append(all(work.done.is_set() for work in works))
        destroy(group)

    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    broadcaster.broadcast([torch.zeros(2), torch.ones(2)])
    assert len(works) == 2 and not any(work.done.is_set() for work in works)  # returned before completion
    broadcaster.close()
    assert destroyed_with == [True]


@pytest.mark.usefixtures("train_extra")
def test_a_stage_leader_keeps_its_group_until_a_sync_names_another() -> None:
    from patchgym.backends.trainer.megatron_sync import SyncGroup

    held = SyncGroup()
    settings = {
        "master_address": "127.0.0.1",
        "master_port": 0,
        "world_size": 1,
        "backend": "gloo",
        "group_name": "stage0_g1",
        "timeout_s": TIMEOUT_S,
    }
    first = held.open(settings)
    first.join()
    port = first.master_port
    assert held.open(settings) is first and held.open({**settings, "master_port": port}) is first
    assert first.joined  # reused as it is: no second rendezvous
    second = held.open({**settings, "group_name": "stage0_g2"})
    assert second is not first and not first.joined  # the old group was closed first
    held.close()
    assert not second.joined
