"""Cluster mode on a real two-node Ray cluster on this machine (tests/ray_nodes.py).

The head (127.0.0.2, resource `node1`) holds both Megatron ranks (TP=2, rank 0 included: the
driver keeps only a proxy); the second raylet (127.0.0.3, resource `node2`) holds the SGLang CPU
engine, which serves on its node's address. `patchgym run` (the driver: rollout loop, local
sandboxes, the SGLang router) joins the cluster from the head. The run does SFT and GRPO steps
with the weights broadcast from trainer rank 0 on node1 to the engine on node2 and checked by
probe log-probs; every address Ray, the engine and the weight group advertise is asserted to lie
in 127.0.0.0/8, and every listening socket of the namespace to be loopback. Then node2's
processes are SIGKILLed mid-GRPO: the run stops with an error naming the engine and its node,
within a bound; node2 is started again and `patchgym run --resume` finishes the run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchgym.core.metrics import read_events
from tests.pipeline_support import check_grpo_accounting, merged
from tests.ray_nodes import LoopbackRayCluster, in_loopback, loopback_or_wildcard
from tests.test_launch import wait_for_event
from tests.test_production_stack import CONFIG, SYNC_TOLERANCE
from tests.test_sglang import require_sglang_venv

pytestmark = [pytest.mark.timeout(3600), pytest.mark.usefixtures("train_extra")]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
NODE1, NODE2 = "127.0.0.2", "127.0.0.3"
STOP_BOUND_S = 240.0
"""How long the run may take to stop after node2 dies (Ray's unreachable/dead verdict, then a clean
stop of the trainer ranks and the router) on a busy 2-core machine."""


def cluster_config(tmp_path: Path, address: str) -> Path:
    """The shipped production-stack config at CI sizes, on the cluster: TP=2 on node1, one CPU engine on node2."""
    config = yaml.safe_load(CONFIG.read_text())
    cache = str(tmp_path / "cache")
    small = {
        "run_dir": str(tmp_path / "run"),
        "tasks": {
            "train": {"options": {"count": 4, "cache_dir": cache}},
            "eval": {"options": {"count": 2, "cache_dir": cache}},
        },
        "sandbox": {"options": {"isolation": "none"}},
        "inference": {"options": {"concurrency": 4, "launch": {"engines": 1, "max_total_tokens": 8192}}},
        "trainer": {"options": {"tp": 2, "micro_batch_tokens": 2048, "warmup_steps": 0, "timeout_s": 300}},
        "env": {"max_turns": 2},
        "agent": {"max_new_tokens_per_turn": 16, "max_tokens_per_trajectory": 512},
        "sft": {"epochs": 1, "batch_size": 4},
        "grpo": {"steps": STEPS, "rollout": {"group_size": 2, "batch_groups": 1, "concurrency": 4}},
        "eval": {"attempts": 1, "concurrency": 4},
        "checkpoint_every": 1,
        "verify_sync_tolerance": SYNC_TOLERANCE,
        "cluster": {
            "backend": "ray",
            "address": address,
            "gloo_socket_ifname": "lo",
            "nccl_socket_ifname": "lo",
            "trainer": {"num_cpus": 1, "num_gpus": 0, "resources": {"node1": 1}},
            "engines": {"num_cpus": 1, "num_gpus": 0, "resources": {"node2": 1}},
            "start_timeout_s": 900,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(merged(config, small)))
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


def test_two_node_ray_cluster_trains_and_a_dead_node_stops_the_run_then_resume_finishes(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("megatron.core")
    require_sglang_venv()
    cluster = LoopbackRayCluster(tmp_path / "cluster", env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        started = time.monotonic()
        cluster.start_node("node1", NODE1, {"node1": 2})
        cluster.wait_nodes(1)
        cluster.start_node("node2", NODE2, {"node2": 1})
        nodes = cluster.wait_nodes(2)
        node_ids = {n["NodeManagerAddress"]: n["NodeID"] for n in nodes if n["Alive"]}
        assert set(node_ids) == {NODE1, NODE2}
        print(f"cluster up in {time.monotonic() - started:.0f} s")

        # -- the run: SFT and GRPO across the nodes, then node2 dies mid-GRPO ---------------------------
        config = cluster_config(tmp_path, cluster.address)
        run_dir = tmp_path / "run"
        first = run(cluster, tmp_path / "first.log", str(config))
        launch = wait_for_event(run_dir, "launch", first)
        check_addresses(launch, node_ids)
        wait_for_event(run_dir, "step", first)
        assert cluster.ns.interfaces() == ["lo"]
        listening = cluster.ns.listening()
        assert listening and all(loopback_or_wildcard(a) for a in listening), listening
        check_syncs(run_dir)
        print(f"first GRPO step {time.monotonic() - started:.0f} s after the start")

        killed_at = time.monotonic()
        cluster.kill_node("node2")
        first.wait(STOP_BOUND_S)
        stop_s = time.monotonic() - killed_at
        output = (tmp_path / "first.log").read_text()
        assert first.returncode != 0, output[-4000:]
        assert "sglang-engine-0" in output and NODE2 in output, output[-4000:]
        stopped_at = json.loads((run_dir / "state.json").read_text())["grpo_step"]
        assert 1 <= stopped_at < STEPS
        print(f"the run stopped {stop_s:.0f} s after node2 was killed")

        # -- node2 back, --resume finishes ------------------------------------------------------------
        cluster.start_node("node2", NODE2, {"node2": 1})
        nodes = cluster.wait_nodes(2)
        node_ids = {n["NodeManagerAddress"]: n["NodeID"] for n in nodes if n["Alive"]}  # node2 has a new id
        resumed = run(cluster, tmp_path / "resume.log", "--resume", str(run_dir))
        resumed.wait(2400)
        assert resumed.returncode == 0, (tmp_path / "resume.log").read_text()[-4000:]
        check_grpo_accounting(run_dir, steps=STEPS)
        launches = read_events(run_dir, "launch")
        assert len(launches) == 2
        check_addresses(launches[1], node_ids)
        syncs = check_syncs(run_dir)
        assert syncs[-1]["version"] == STEPS + 1  # after SFT, then after every GRPO step
        print(f"whole test {time.monotonic() - started:.0f} s")
    finally:
        cluster.close()
    assert cluster.ns.members() == [], "a process of the cluster or of a run outlived the test"
