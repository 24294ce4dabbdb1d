"""Cluster mode on a real two-node Ray cluster on this machine (tests/ray_nodes.py).

The head (127.0.0.2, resource `node1`) holds both Megatron ranks (TP=2, rank 0 included: the
driver keeps only a proxy); the second raylet (127.0.0.3, resource `node2`) holds the SGLang CPU
engine, which serves on its node's address. `patchgym run` (the driver: rollout loop, local
sandboxes, the SGLang router) joins the cluster from the head. The run does SFT and GRPO steps
with the weights broadcast from trainer rank 0 on node1 to the engine on node2 and checked by
probe log-probs; every address Ray, the engine and the weight group advertise is asserted to lie
in 127.0.0.0/8, and every listening socket of the namespace to be loopback. Then, each time
within a bound and with an error naming what died and where: node2's processes are SIGKILLed
mid-GRPO and the run stops; node2 is started again, `--resume` continues, and trainer rank 1's
process is SIGKILLed; the next `--resume` finishes the run. First, a role the cluster cannot
place fails within `start_timeout_s`, listing the cluster's resources.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchgym.core.metrics import read_events
from tests.pipeline_support import check_grpo_accounting, merged
from tests.ray_nodes import LoopbackRayCluster, in_loopback, loopback_or_wildcard
from tests.test_launch import wait_gone
from tests.test_production_stack import SYNC_TOLERANCE, stack_config
from tests.test_sglang import require_sglang_venv

pytestmark = [pytest.mark.timeout(3600), pytest.mark.usefixtures("train_extra")]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
NODE1, NODE2 = "127.0.0.2", "127.0.0.3"
STOP_BOUND_S = 240.0
"""How long the run may take to stop after node2 dies (Ray's unreachable/dead verdict, then a clean
stop of the trainer ranks and the router) on a busy 2-core machine."""


def cluster_config(tmp_path: Path, address: str) -> Path:
    """The production-stack test's config (TP=2, CI sizes) with one CPU engine, on the cluster:
    both ranks on node1, the engine on node2, gloo and NCCL pinned to loopback."""
    path, _ = stack_config(tmp_path, STEPS)
    cluster = {
        "backend": "ray",
        "address": address,
        "gloo_socket_ifname": "lo",
        "nccl_socket_ifname": "lo",
        "trainer": {"num_cpus": 1, "num_gpus": 0, "resources": {"node1": 1}},
        "engines": {"num_cpus": 1, "num_gpus": 0, "resources": {"node2": 1}},
        "start_timeout_s": 900,
    }
    changes = {"inference": {"options": {"launch": {"engines": 1}}}, "cluster": cluster}
    path.write_text(yaml.safe_dump(merged(yaml.safe_load(path.read_text()), changes)))
    return path


def run(cluster: LoopbackRayCluster, log: Path, *args: str) -> Any:
    """`patchgym run ...` as a driver inside the cluster's namespace."""
    command = [sys.executable, "-m", "patchgym.cli", "run", *args]
    return cluster.popen(command, log=log, env={"OMP_NUM_THREADS": "1"})


def check_addresses(launch: dict[str, Any], node_ids: dict[str, str]) -> None:
    """Every address the cluster, the engine and the ranks advertise is loopback; ranks on node1, engine on node2."""
    info = launch["cluster"]
    advertised = [info["gcs_address"], info["driver_address"], *(n["address"] for n in info["nodes"])]
    advertised += [a["address"] for role in info["actors"].values() for a in role]
    engines = launch["inference"]
    advertised += [*engines["urls"], engines["router_url"]]
    assert advertised and all(in_loopback(a) for a in advertised), advertised
    assert info["gcs_address"].startswith(f"{NODE1}:") and info["driver_address"] == NODE1
    ranks = info["actors"]["trainer"]
    assert [r["name"] for r in ranks] == ["trainer-rank-0", "trainer-rank-1"]
    assert {(r["address"], r["node_id"]) for r in ranks} == {(NODE1, node_ids[NODE1])}
    (engine,) = info["actors"]["engines"]
    assert (engine["address"], engine["node_id"]) == (NODE2, node_ids[NODE2])
    assert engines["urls"][0].startswith(f"http://{NODE2}:") and engines["router_url"].startswith("http://127.0.0.1:")
    assert launch["trainer"]["ranks_started_by"] == "ray" and launch["trainer"]["tp"] == 2
    assert launch["trainer"]["threads"] == 1  # cluster.trainer.num_cpus, not every core of the node


def check_syncs(run_dir: Path) -> list[dict[str, Any]]:
    """Every sync crossed the nodes: its group met at trainer rank 0's node, the engine took the version,
    and its probe log-probs matched the trainer's."""
    syncs = read_events(run_dir, "weight_sync")
    assert syncs
    for sync in syncs:
        assert sync["mode"] == "distributed" and sync["groups"] == 1 and sync["bytes"] > 0, sync
        assert [m.rsplit(":", 1)[0] for m in sync["masters"]] == [NODE1], sync
        assert sync["engine_versions"] == [sync["version"]], sync
        assert sync["logprob_gap"] is not None and sync["logprob_gap"] <= SYNC_TOLERANCE, sync
    return syncs


def wait_for_events(run_dir: Path, kind: str, count: int, process: Any, bound_s: float = 2400.0) -> list[dict]:
    """The run's `kind` events once there are `count` of them (the running `process` must not exit first)."""
    deadline = time.monotonic() + bound_s
    while len(events := read_events(run_dir, kind) if (run_dir / "events.jsonl").exists() else []) < count:
        assert process.poll() is None, f"the run exited ({process.returncode}) before {count} {kind} events"
        assert time.monotonic() < deadline, f"fewer than {count} {kind} events within {bound_s:.0f} s"
        time.sleep(0.5)
    return events


def stopped(process: Any, log: Path, *names: str) -> str:
    """The run `process` exits within STOP_BOUND_S, failing, with an error naming each of `names`."""
    process.wait(STOP_BOUND_S)
    output = log.read_text()
    assert process.returncode != 0, output[-4000:]
    assert all(name in output for name in names), output[-4000:]
    return output


def live_nodes(cluster: LoopbackRayCluster) -> dict[str, str]:
    """Node address -> node id of the live nodes, once both are up."""
    return {n["NodeManagerAddress"]: n["NodeID"] for n in cluster.wait_nodes(2) if n["Alive"]}


def test_two_node_ray_cluster_trains_and_stops_on_a_dead_node_or_rank_then_resume_finishes(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("megatron.core")
    require_sglang_venv()
    cluster = LoopbackRayCluster(tmp_path / "cluster", env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        started = time.monotonic()
        cluster.start_node("node1", NODE1, {"node1": 2})
        cluster.wait_nodes(1)
        cluster.start_node("node2", NODE2, {"node2": 1})
        node_ids = live_nodes(cluster)
        assert set(node_ids) == {NODE1, NODE2}
        print(f"cluster up in {time.monotonic() - started:.0f} s")
        config = cluster_config(tmp_path, cluster.address)
        run_dir = tmp_path / "run"

        # -- a role the cluster cannot place is a clear error within start_timeout_s -------------------
        unplaceable = tmp_path / "unplaceable.yaml"
        changes = {"run_dir": str(tmp_path / "unplaceable"), "cluster": {"engines": {"resources": {"node3": 1}}}}
        changes["cluster"]["start_timeout_s"] = 20
        unplaceable.write_text(yaml.safe_dump(merged(yaml.safe_load(config.read_text()), changes)))
        log = tmp_path / "unplaceable.log"
        stopped(run(cluster, log, str(unplaceable)), log, "could not place the engines", "node3", "node1: 2")

        # -- the run: SFT and GRPO across the nodes, then node2 dies mid-GRPO ---------------------------
        first = run(cluster, tmp_path / "first.log", str(config))
        (launch,) = wait_for_events(run_dir, "launch", 1, first)
        check_addresses(launch, node_ids)
        wait_for_events(run_dir, "step", 1, first)
        assert cluster.ns.interfaces() == ["lo"]
        listening = cluster.ns.listening()
        assert listening and all(loopback_or_wildcard(a) for a in listening), listening
        check_syncs(run_dir)
        print(f"first GRPO step {time.monotonic() - started:.0f} s after the start")
        killed_at = time.monotonic()
        cluster.kill_node("node2")
        stopped(first, tmp_path / "first.log", "sglang-engine-0", NODE2)
        print(f"the run stopped {time.monotonic() - killed_at:.0f} s after node2 was killed")
        steps_done = json.loads((run_dir / "state.json").read_text())["grpo_step"]
        assert 1 <= steps_done < STEPS - 1

        # -- node2 back: --resume continues; then trainer rank 1's process dies -------------------------
        cluster.wait_nodes(1)  # Ray has marked the killed node dead (the run may stop before it does)
        cluster.start_node("node2", NODE2, {"node2": 1})
        node_ids = live_nodes(cluster)  # node2 has a new id
        second = run(cluster, tmp_path / "second.log", "--resume", str(run_dir))
        launch = wait_for_events(run_dir, "launch", 2, second)[-1]
        check_addresses(launch, node_ids)
        wait_for_events(run_dir, "step", steps_done + 1, second)
        ranks = launch["cluster"]["actors"]["trainer"]
        server = json.loads((run_dir / "logs/sglang-engine-0/processes.json").read_text())["children"][0]["pid"]
        run_pids = [*(r["pid"] for r in ranks), launch["cluster"]["actors"]["engines"][0]["pid"], server]
        killed_at = time.monotonic()
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        stopped(second, tmp_path / "second.log", "trainer-rank-1", NODE1)
        print(f"the run stopped {time.monotonic() - killed_at:.0f} s after trainer rank 1 was killed")
        assert wait_gone(run_pids) == [], "Ray ends the actors (and the engine's server) of a driver that exited"

        # -- --resume finishes --------------------------------------------------------------------------
        last = run(cluster, tmp_path / "last.log", "--resume", str(run_dir))
        last.wait(2400)
        assert last.returncode == 0, (tmp_path / "last.log").read_text()[-4000:]
        check_grpo_accounting(run_dir, steps=STEPS)
        # (a resume drops the events after the last checkpoint: the killed run's launch may be gone)
        launches = read_events(run_dir, "launch")
        assert len(launches) >= 2
        check_addresses(launches[-1], node_ids)
        syncs = check_syncs(run_dir)
        assert syncs[-1]["version"] == STEPS + 1  # after SFT, then after every GRPO step
        print(f"whole test {time.monotonic() - started:.0f} s")
    finally:
        cluster.close()
    assert cluster.ns.members() == [], "a process of the cluster or of a run outlived the test"
