"""Cluster mode without a cluster: the `cluster:` settings, the placement value object, rank order,
the checks a run config gets, and that a run without `cluster:` never imports Ray.

The real two-node Ray cluster runs in tests/test_ray_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchgym.core.errors import ConfigError
from patchgym.launch.cluster import (
    ClusterNode,
    ClusterSettings,
    RayPlacement,
    RolePlacement,
    plan_placement,
    rank_order,
)
from patchgym.launch.placement import Slot, place_roles
from patchgym.pipeline.config import RunConfig
from tests.pipeline_support import merged, run_config

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"launch": {"engines": 3, "tp": 2}, "max_context": 1024}


def test_settings_pin_the_interfaces_and_pass_the_environment() -> None:
    settings = ClusterSettings(backend="ray", nccl_socket_ifname="ens5", env={"HIP_FORCE_DEV_KERNARG": "1"})
    assert settings.actor_env() == {"NCCL_SOCKET_IFNAME": "ens5", "HIP_FORCE_DEV_KERNARG": "1"}
    assert ClusterSettings(backend="ray", gloo_socket_ifname="lo").actor_env() == {"GLOO_SOCKET_IFNAME": "lo"}
    with pytest.raises(ValueError, match="backend"):
        ClusterSettings.model_validate({"backend": "slurm"})
    with pytest.raises(ValueError, match="extra"):
        ClusterSettings.model_validate({"backend": "ray", "adress": "10.0.0.1:6379"})


def test_placement_reserves_a_bundle_per_rank_and_per_engine() -> None:
    settings = ClusterSettings.model_validate(
        {"backend": "ray", "trainer": {"resources": {"node1": 1}}, "engines": {"num_cpus": 2, "strategy": "SPREAD"}}
    )
    placement = plan_placement(settings, {"tp": 2, "pp": 2, "dp": 2}, ENGINES)
    assert placement.world == 8 and placement.trainer.count == 8
    assert placement.trainer.bundles()[0] == {"CPU": 1.0, "GPU": 1.0, "node1": 1.0}  # one GPU per rank by default
    assert placement.engines.count == 3 and placement.engines.strategy == "SPREAD"
    assert placement.engines.bundle == {"CPU": 2.0, "GPU": 2.0}  # an engine takes its tp GPUs by default
    cpu = plan_placement(settings, {}, {"launch": {"engines": 1, "cpu_venv": True}, "max_context": 8})
    assert cpu.engines.bundle == {"CPU": 2.0} and cpu.world == 1  # CPU engines reserve no GPU
    attached = plan_placement(settings, {"tp": 2}, {"urls": ["http://10.0.0.5:30000"], "max_context": 8})
    assert attached.engines.count == 0 and attached.engines.bundles() == []


@pytest.mark.parametrize(
    ("trainer", "inference", "message"),
    [
        ({}, {"launch": {"engines": 1, "gpus": [0]}}, "drop launch.gpus"),
        ({}, {"launch": {"engines": 0}}, "invalid sglang launch settings"),
    ],
)
def test_placement_refuses_what_ray_cannot_honour(trainer: dict, inference: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_placement(ClusterSettings(backend="ray"), trainer, inference)


def test_a_bundle_must_reserve_something_and_nothing_negative() -> None:
    with pytest.raises(ConfigError, match="reserves nothing"):
        RolePlacement("trainer", 2, {})
    with pytest.raises(ConfigError, match=">= 0"):
        RolePlacement("engines", 1, {"CPU": 1, "node2": -1})
    empty = ClusterSettings.model_validate({"backend": "ray", "trainer": {"num_cpus": 0, "num_gpus": 0}})
    with pytest.raises(ConfigError, match="cluster.trainer reserves nothing"):
        plan_placement(empty, {}, {})
    with pytest.raises(ConfigError, match="4 trainer bundles for tp\\*pp\\*dp = 2"):
        RayPlacement(RolePlacement("trainer", 4, {"CPU": 1}), RolePlacement("engines", 0, {}), tp=2)


@pytest.mark.parametrize(("tp", "dp", "pp"), [(1, 1, 2), (2, 1, 2), (2, 2, 2), (1, 4, 2), (4, 2, 4)])
def test_stage_leaders_are_megatrons_tensor_and_data_rank_0_of_each_stage(tp: int, dp: int, pp: int) -> None:
    """The rank that hosts a stage's weight group, against megatron-core's own rank layout."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    placement = RayPlacement(
        RolePlacement("trainer", tp * dp * pp, {"CPU": 1}), RolePlacement("engines", 0, {}), tp, pp, dp
    )
    # rank 0's pipeline: tensor and data-parallel rank 0 of every stage, stage by stage
    (first_pipeline,) = [group for group in generator.get_ranks("pp") if 0 in group]
    assert [placement.stage_leader(s) for s in range(pp)] == first_pipeline
    with pytest.raises(ConfigError):
        placement.stage_leader(pp)


def test_rank_order_keeps_each_nodes_bundles_together() -> None:
    assert rank_order(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert rank_order(["n2", "n2", "n1"]) == [0, 1, 2]
    assert rank_order([]) == []


def cluster_config(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    trainer = {"name": "megatron", "options": {"tp": 2}}
    inference = {"name": "sglang", "options": {"launch": {"engines": 1, "cpu_venv": True}, "max_context": 1024}}
    base = {"trainer": trainer, "inference": inference, "cluster": {"backend": "ray", "address": "127.0.0.2:6380"}}
    return merged(run_config(tmp_path, steps=1), {**base, **changes})


def test_a_run_config_with_a_cluster_is_checked(tmp_path: Path) -> None:
    config = RunConfig.model_validate(cluster_config(tmp_path))
    assert config.cluster is not None and config.cluster.address == "127.0.0.2:6380"
    with pytest.raises(ValueError, match="places megatron trainer ranks and sglang engines"):
        RunConfig.model_validate(cluster_config(tmp_path, trainer={"name": "embedded", "options": {}}))
    with pytest.raises(ValueError, match="weight_sync: tensor"):
        RunConfig.model_validate(cluster_config(tmp_path, weight_sync="tensor"))
    with pytest.raises(ValueError, match="start_timeout_s"):
        RunConfig.model_validate(cluster_config(tmp_path, cluster={"backend": "ray", "start_timeout_s": 0}))


def test_base_gpu_is_0_unless_ray_leaves_the_visible_devices_alone() -> None:
    pytest.importorskip("ray")
    from patchgym.launch.ray_cluster import base_gpu

    assert base_gpu(["3", "4"], {}) == 0  # Ray set CUDA_VISIBLE_DEVICES=3,4: the server sees them as 0, 1
    assert base_gpu(["3", "4"], {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}) == 3
    assert base_gpu([], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}) == 0


@pytest.mark.usefixtures("train_extra")
@pytest.mark.timeout(900)
def test_a_run_without_a_cluster_never_imports_ray(tmp_path: Path) -> None:
    """The one-machine path is unchanged: a whole `patchgym run` (embedded parts) ends without `ray` in
    sys.modules, while Ray is installed (so its absence is the code's doing)."""
    pytest.importorskip("ray")
    changes = {"sft": {"enabled": False}, "eval": {"limit": 1}, "metrics": {"tensorboard": False}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(merged(run_config(tmp_path, steps=1), changes)))
    script = textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = ["patchgym", "run", {str(config)!r}]
        try:
            runpy.run_module("patchgym.cli", run_name="__main__")
        except SystemExit as exit:
            assert not exit.code, exit.code
        print("ray imported" if "ray" in sys.modules else "ray not imported")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=850)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ray not imported"


# -- the nodes the dry run places on -----------------------------------------------------------------
def nodes(*specs: dict[str, Any]) -> list[ClusterNode]:
    return ClusterSettings.model_validate({"backend": "ray", "nodes": list(specs)}).node_list()


def role(name: str, count: int, strategy: str = "PACK", **bundle: float) -> RolePlacement:
    return RolePlacement(name, count, {"CPU": 1.0, **bundle}, strategy)  # type: ignore[arg-type]


def where(slots: list[Slot]) -> list[tuple[str, tuple[int, ...]]]:
    return [(slot.node.name, slot.gpus) for slot in slots]


def test_nodes_expand_and_are_named_once() -> None:
    found = nodes({"name": "a", "address": "10.0.0.1", "gpus": 8}, {"name": "b", "count": 2, "gpus": 4})
    assert [(n.name, n.address, n.gpus) for n in found] == [("a", "10.0.0.1", 8), ("b-0", "b-0", 4), ("b-1", "b-1", 4)]
    with pytest.raises(ConfigError, match="names b-0 more than once"):
        nodes({"name": "b", "count": 2}, {"name": "b-0"})
    with pytest.raises(ConfigError, match="address names one node, but count is 2"):
        nodes({"name": "b", "count": 2, "address": "10.0.0.2"})
    with pytest.raises(ValueError, match="extra"):
        nodes({"name": "a", "gpu": 8})


def test_roles_take_gpus_by_resources_and_strategy() -> None:
    """Engines first, then the ranks, sharing each node's GPUs; custom resources pin a role to its nodes."""
    cluster = nodes(
        {"name": "t", "gpus": 8, "resources": {"trainer_node": 8}},
        {"name": "i", "count": 2, "gpus": 8, "resources": {"engine_node": 8}},
    )
    engines, trainer = role("engines", 12, GPU=1, engine_node=1), role("trainer", 8, GPU=1, trainer_node=1)
    slots = place_roles([engines, trainer], cluster)
    assert where(slots["engines"]) == [("i-0", (g,)) for g in range(8)] + [("i-1", (g,)) for g in range(4)]
    assert where(slots["trainer"]) == [("t", (g,)) for g in range(8)]
    shared = nodes({"name": "n", "count": 2, "gpus": 8})
    slots = place_roles([role("engines", 2, GPU=2), role("trainer", 4, "SPREAD", GPU=1)], shared)
    assert where(slots["engines"]) == [("n-0", (0, 1)), ("n-0", (2, 3))]  # PACK: one node while it fits
    assert where(slots["trainer"]) == [("n-0", (4,)), ("n-1", (0,)), ("n-0", (5,)), ("n-1", (1,))]  # SPREAD
    halves = place_roles([role("engines", 3, GPU=0.5)], shared)["engines"]
    assert where(halves) == [("n-0", (0,)), ("n-0", (0,)), ("n-0", (1,))]  # shares of one GPU
    assert where(place_roles([role("trainer", 2, "STRICT_SPREAD", GPU=1)], shared)["trainer"]) == [
        ("n-0", (0,)), ("n-1", (0,)),
    ]  # fmt: skip


def test_a_bundle_that_fits_nowhere_says_what_is_free() -> None:
    cluster = nodes({"name": "one", "gpus": 8, "cpus": 16})
    with pytest.raises(ConfigError, match=r"cluster.engines: engine 8 of 9 .* \(one: 0 of 8 GPUs free, 8 CPUs\)"):
        place_roles([role("engines", 9, GPU=1)], cluster)
    with pytest.raises(ConfigError, match="trainer rank 0 of 1 .*fits on no node"):
        place_roles([role("trainer", 1, GPU=1, trainer_node=1)], cluster)  # no node offers trainer_node
    with pytest.raises(ConfigError, match="the 3 trainer .*all on one node"):
        place_roles([role("trainer", 3, "STRICT_PACK", GPU=4)], cluster)
    with pytest.raises(ConfigError, match="trainer rank 1 of 2 .*each on its own node"):
        place_roles([role("trainer", 2, "STRICT_SPREAD", GPU=1)], cluster)


def test_ray_start_settings_are_refused_in_cluster_env() -> None:
    """RAY_EXPERIMENTAL_NOSET_* decide which GPUs Ray's workers see where `ray start` runs: not a run's setting."""
    with pytest.raises(ValueError, match="RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES belong in the environment of "
                       "`ray start` on every node, not in cluster.env"):  # fmt: skip
        ClusterSettings.model_validate(
            {"backend": "ray", "env": {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "NCCL_DEBUG": "WARN"}}
        )
    assert ClusterSettings.model_validate({"backend": "ray", "env": {"NCCL_DEBUG": "WARN"}}).env == {
        "NCCL_DEBUG": "WARN"
    }


def test_each_ray_rank_gets_the_threads_its_bundle_reserves() -> None:
    """Without `threads`, torch in a Ray rank actor uses every core of its node, as many times as ranks share it."""
    settings = ClusterSettings.model_validate({"backend": "ray", "trainer": {"num_cpus": 4}})
    placement = plan_placement(settings, {"tp": 2, "dp": 2, "lr": 1e-5}, {})
    assert placement.rank_options({"tp": 2, "dp": 2, "lr": 1e-5}) == {"threads": 4, "tp": 2, "lr": 1e-5}
    assert placement.rank_options({"threads": 2})["threads"] == 2  # the config's own value wins
    fraction = plan_placement(ClusterSettings.model_validate({"backend": "ray", "trainer": {"num_cpus": 0.5}}), {}, {})
    assert fraction.rank_options({})["threads"] == 1
