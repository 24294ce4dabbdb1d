"""`patchgym run --dry-run`: the launch plan is what the launch starts, SGLang's own parser accepts the
rendered server arguments, megatron-core agrees with the rank layout, and the dry run starts nothing."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from patchgym.backends.inference.sglang_launch import SERVER_CONTEXT_HEADROOM
from patchgym.backends.trainer.parallel import MegatronLayout
from patchgym.cli import app
from patchgym.core.plugins import registry
from patchgym.launch.context import run_logs
from patchgym.launch.plan import LaunchPlan, PlannedPorts, ProcessPlan
from patchgym.launch.processes import Supervisor
from patchgym.pipeline.config import load_run_config
from patchgym.pipeline.dry_run import plan_run
from tests.test_reference_config import QWEN3_30B_A3B

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "configs" / "reference" / "qwen3-30b-a3b-mi355x.yaml"
CPU_STACK = ROOT / "configs" / "megatron-sglang.yaml"
QWEN_PATH = "/models/Qwen3-30B-A3B-Instruct-2507-sft"
"""The reference's model.path."""
SUBPROCESS_BOUND_S = 900
"""A generous bound on one CLI or parser subprocess (seconds on an idle machine; minutes on a loaded one)."""


def plan_of(path: Path) -> LaunchPlan:
    return plan_run(load_run_config(path), ["patchgym", "run", str(path)])


def flag(argv: tuple[str, ...] | list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def write_config(tmp_path: Path, source: Path, changes: dict[str, Any]) -> Path:
    """`source` with `changes` merged in (one level deep per top-level key)."""
    data = yaml.safe_load(source.read_text())
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# -- the plan ------------------------------------------------------------------------------------
def test_reference_plan_places_the_recipe_on_its_nodes() -> None:
    """The reference's cluster block: 24 engines on the three inference nodes, 8 ranks on the trainer node,
    each with its GPU, the engines' server commands as their actors run them, and a memory estimate each."""
    plan = plan_of(REFERENCE)
    assert plan.placement == "ray"
    engines = [p for p in plan.processes if p.role == "engine"]
    assert len(engines) == 24
    assert [(p.where.node, p.where.gpus) for p in engines] == [(f"inference-{i // 8}", (i % 8,)) for i in range(24)]
    assert [flag(p.argv, "--host") for p in engines] == [f"inference-{i // 8}" for i in range(24)]
    assert {flag(p.argv, "--base-gpu-id") for p in engines} == {"0"}  # Ray shows each actor only its GPU
    assert len({flag(p.argv, "--port") for p in engines}) == 24
    for engine in engines:
        assert engine.argv[1:3] == ("-m", "sglang.launch_server") and engine.argv[0] == sys.executable
        assert flag(engine.argv, "--context-length") == str(65536 + SERVER_CONTEXT_HEADROOM)
        assert flag(engine.argv, "--mem-fraction-static") == "0.7" and "--device" not in engine.argv
        assert engine.env["SGLANG_USE_AITER"] == "1" and engine.env["HF_HUB_OFFLINE"] == "1"
        assert engine.env["NCCL_SOCKET_IFNAME"] == "ens50f0"  # the cluster's actor environment
        assert engine.where.resources == {"CPU": 1.0, "GPU": 1.0, "engine_node": 1.0}
        assert engine.memory is not None and engine.memory.facts["kv_tokens"] > 1_400_000
    (router,) = [p for p in plan.processes if p.role == "router"]
    workers = router.argv.index("--worker-urls")
    assert list(router.argv[workers + 1 : workers + 25]) == list(plan.engine_urls) == [p.url for p in engines]
    assert router.where.node == "local" and plan.engine_urls[0].startswith("http://inference-0:")
    assert plan.layout == MegatronLayout(tp=4, pp=1, dp=2, ep=8, etp=1)
    assert plan.ranks_by_node() == {"trainer": list(range(8))}
    ranks = [p for p in plan.processes if p.role == "trainer"]
    assert [(p.rank, p.where.gpus, p.where.host) for p in ranks] == [(r, (r,), "10.0.0.1") for r in range(8)]
    assert all(p.coords == plan.layout.coords(p.rank or 0) and p.argv == () for p in ranks)  # Ray actors
    for rank in ranks:
        assert rank.memory is not None and rank.memory.fits and rank.memory.device_bytes == 288e9
        assert set(rank.memory.parts) >= {"parameters", "gradients", "optimizer", "activations", "weight sync"}
    assert plan.processes[0].rank is None  # the driver drives rank 0's actor
    assert any("is not a folder" in note for note in plan.notes)  # the model is not on this machine
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["layout"]["world"] == 8 and data["gpus_by_node"]["inference-2"]["gpus"] == 8
    entry = next(p for p in data["processes"] if p["name"] == "trainer-rank-3")
    assert (entry["where"]["node"], entry["where"]["gpus"], entry["memory"]["fits"]) == ("trainer", [3], True)
    assert entry["memory"]["parts_gb"]["parameters"] == pytest.approx(8.0, rel=0.02)


def test_a_placer_decides_where_each_process_runs(tmp_path: Path) -> None:
    """Without cluster: the placement is one input: a placer fills `Where`, and the plan groups ranks by node."""

    class TwoNodes:
        name = "two-nodes"

        def place(self, plan: LaunchPlan) -> LaunchPlan:
            def where(p: ProcessPlan) -> ProcessPlan:
                node = "trainer-node" if p.rank is not None else "inference-node"
                return replace(p, where=replace(p.where, node=node))

            return replace(plan, processes=tuple(where(p) for p in plan.processes))

    config = load_run_config(write_config(tmp_path, REFERENCE, {"cluster": None, **APART}))
    plan = plan_run(config, ["patchgym", "run"], placer=TwoNodes())
    assert plan.placement == "two-nodes" and plan.ranks_by_node() == {"trainer-node": list(range(8))}
    assert plan.nodes()["inference-node"] == [*(f"sglang-engine-{i}" for i in range(24)), "sglang-router"]
    assert plan.to_dict()["processes"][1]["where"]["node"] == "inference-node"
    assert plan_run(config, ["patchgym", "run"]).ranks_by_node() == {"local": list(range(8))}


APART = {"inference": {"options": {"max_context": 65536, "launch": {"engines": 24, "gpus": list(range(8, 32))}}}}
"""The reference's engines on GPUs 8-31 of one machine, apart from the ranks' 0-7."""


def test_one_host_gpus_given_twice_are_an_error_naming_them(tmp_path: Path) -> None:
    """The reference's layout forced onto one machine (no cluster:): the engines' GPUs 0-23 and the ranks'
    0-7 overlap, and the dry run refuses it naming every shared GPU and its two holders."""
    result = runner.invoke(app, ["run", "--dry-run", str(write_config(tmp_path, REFERENCE, {"cluster": None}))])
    shown = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "GPUs 0-7 of node local are given twice (GPU 0: driver and sglang-engine-0, GPU 1: sglang-engine-1 " \
        "and trainer-rank-1," in shown  # fmt: skip
    assert "GPU 7: sglang-engine-7 and trainer-rank-7)" in shown and "cluster: with nodes" in shown
    apart = write_config(tmp_path, REFERENCE, {"cluster": None, **APART})
    plan = plan_run(load_run_config(apart), ["patchgym", "run"])
    assert [p.where.gpus for p in plan.processes if p.rank is not None] == [(r,) for r in range(8)]
    assert any("this machine shows no GPU" in note for note in plan.notes)
    one_node = {"nodes": [{"name": "one", "gpus": 8, "resources": {"trainer_node": 8, "engine_node": 8}}]}
    crowded = write_config(tmp_path, REFERENCE, {"cluster": one_node})
    result = runner.invoke(app, ["run", "--dry-run", str(crowded)])
    assert result.exit_code == 2 and "cluster.engines: engine 8 of 24" in " ".join(result.output.split())
    assert "fits on no node of cluster.nodes (one: 0 of 8 GPUs free" in " ".join(result.output.split())


def test_what_does_not_fit_its_gpu_is_refused_with_the_setting_to_change(tmp_path: Path) -> None:
    dense = {"trainer": {"options": {**load_run_config(REFERENCE).trainer.options, "micro_batch_tokens": 262144}}}
    result = runner.invoke(app, ["run", "--dry-run", str(write_config(tmp_path, REFERENCE, dense))])
    shown = " ".join(result.output.split())
    assert result.exit_code == 2 and "trainer-rank-0 needs about" in shown and "its GPU has 288 GB" in shown
    assert "micro_batch_tokens=262144" in shown and "recompute: selective or full" in shown
    small = {"nodes": [{"name": "n", "count": 4, "gpus": 8, "gpu_memory_gb": 80,
                       "resources": {"trainer_node": 2, "engine_node": 6}}]}  # fmt: skip
    result = runner.invoke(app, ["run", "--dry-run", str(write_config(tmp_path, REFERENCE, {"cluster": small}))])
    shown = " ".join(result.output.split())
    assert result.exit_code == 2 and "sglang-engine-0: its weights take 61.1 GB per GPU" in shown, result.output


def test_the_launch_starts_what_the_plan_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real launchers (the registry's sglang and megatron factories, as the pipeline builds them)
    start exactly the processes the dry run shows: same names, command lines and environments."""
    pytest.importorskip("megatron.core")
    changes = {
        "inference": {
            "options": {"max_context": 1024, "launch": {"engines": 2, "python": "/opt/sgl/bin/python", "gpus": [4, 5]}}
        },
        "trainer": {"options": {"tp": 2, "pp": 1, "dp": 2, "lr": 0.001}},
    }
    config = load_run_config(write_config(tmp_path, CPU_STACK, changes))
    plan = plan_run(config, ["patchgym", "run"])
    assert [p.name for p in plan.processes[1:]] == [
        "sglang-engine-0", "sglang-engine-1", "sglang-router", "trainer-rank-1", "trainer-rank-2", "trainer-rank-3",
    ]  # fmt: skip

    started: list[tuple[str, list[str], dict[str, str] | None]] = []

    def record(self: Supervisor, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        started.append((name, list(command), env))

    class Stop(Exception):
        """Ends the trainer's launch where rank 0 would wait for its followers."""

    def stop_at_rendezvous(*_: Any) -> None:
        raise Stop

    ports = PlannedPorts()  # the same stand-in ports, taken in the same order as the plan took them
    monkeypatch.setattr("patchgym.launch.engines.free_port", ports)
    monkeypatch.setattr("patchgym.launch.ranks.free_port", ports)
    monkeypatch.setattr(Supervisor, "start", record)
    monkeypatch.setattr("patchgym.launch.ranks.join_watching", stop_at_rendezvous)
    model = str(Path(config.run_dir) / "model-init")
    with run_logs(tmp_path):
        engine = registry().create("inference", config.inference.name, model=model, **config.inference.options)
        try:
            with pytest.raises(Stop):
                registry().create("trainer", config.trainer.name, model=model, **config.trainer.options)
        finally:
            asyncio.run(engine.aclose())
    assert started == [(p.name, list(p.argv), p.environ()) for p in plan.processes[1:]]


# -- SGLang's own argument parser ------------------------------------------------------------------
PARSE = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.server_args import prepare_server_args  # what `python -m sglang.launch_server` parses with

    FIELDS = ("model_path", "host", "port", "context_length", "base_gpu_id", "mem_fraction_static", "device",
              "tp_size", "dtype", "max_total_tokens", "sleep_on_idle", "attention_backend")
    results = []
    for argv in json.load(sys.stdin):
        try:
            args = prepare_server_args(argv)
        except SystemExit as exc:  # argparse refuses: exit status 2 and a message on stderr
            results.append({"refused": exc.code})
        else:
            results.append({name: getattr(args, name) for name in FIELDS})
    print(json.dumps(results))
    """
)


def test_rendered_sglang_arguments_pass_sglangs_own_parser() -> None:
    """Every server command of the reference and of the CPU stack parses with SGLang's `ServerArgs` parser
    (`add_cli_args` + `from_cli_args`, in the CPU SGLang venv), to the values the plan meant."""
    from patchgym.backends.inference.sglang_venv import stubs_path, venv_python
    from tests.test_sglang import require_sglang_venv

    venv = require_sglang_venv()
    engines = {path: [p for p in plan_of(path).processes if p.role == "engine"] for path in (REFERENCE, CPU_STACK)}
    assert all(p.argv[0] == str(venv_python(venv)) for p in engines[CPU_STACK])  # the venv's path, not built
    argvs = [list(p.argv[3:]) for path in engines for p in engines[path]]
    control = ["--model-path", "/m", "--no-such-flag", "1"]
    done = subprocess.run(
        [str(venv_python(venv)), "-c", PARSE],
        input=json.dumps([*argvs, control]),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(stubs_path(venv))},
        timeout=SUBPROCESS_BOUND_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *parsed, refused = json.loads(done.stdout.strip().splitlines()[-1])
    assert refused == {"refused": 2}  # the parser is strict: an unknown flag is refused
    assert len(parsed) == 24 + 2 and not [p for p in parsed if "refused" in p], parsed
    for engine, args in zip([p for path in engines for p in engines[path]], parsed, strict=True):
        assert args["port"] == int(flag(engine.argv, "--port")) and args["host"] == flag(engine.argv, "--host")
        assert args["model_path"] == flag(engine.argv, "--model-path")
    reference, cpu = parsed[:24], parsed[24:]
    assert [a["base_gpu_id"] for a in reference] == [0] * 24  # each Ray actor sees only its own GPU
    assert all(
        a["context_length"] == 65536 + SERVER_CONTEXT_HEADROOM and a["mem_fraction_static"] == 0.7 for a in reference
    )
    assert all(a["tp_size"] == 1 and a["dtype"] == "auto" for a in reference)
    assert all(a["device"] == "cpu" and a["attention_backend"] == "torch_native" and a["sleep_on_idle"] for a in cpu)
    assert all(a["context_length"] == 1024 + SERVER_CONTEXT_HEADROOM and a["max_total_tokens"] == 32768 for a in cpu)


# -- megatron-core's layout ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout",
    [None, MegatronLayout(tp=2, pp=2, dp=2, ep=2, etp=1), MegatronLayout(tp=2, pp=2, dp=4, ep=4, etp=1)],
    ids=["reference", "tp2-pp2-dp2-ep2", "tp2-pp2-dp4-ep4"],
)
def test_the_plans_layout_is_megatron_cores(layout: MegatronLayout | None) -> None:
    """megatron-core's TransformerConfig takes the layout as the trainer builds it for Qwen3-30B-A3B, and
    every rank's place in each group is the one megatron's own rank arithmetic gives it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    from patchgym.backends.trainer.megatron_convert import Layout

    layout = layout or plan_of(REFERENCE).layout
    assert layout is not None
    config = Layout(transformers.Qwen3MoeConfig(**QWEN3_30B_A3B)).transformer_config(
        tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, dtype=torch.bfloat16
    )
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (layout.tp, layout.pp)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (layout.ep, layout.etp)
    assert config.sequence_parallel == (layout.tp > 1) and config.num_moe_experts == 128
    order = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default, for both generators
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=1, order=order)
    experts = RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1, order=order)
    coords = [layout.coords(rank) for rank in range(layout.world)]
    for generator, names in (
        (dense, {"tp": "tp", "dp": "dp", "pp": "pp"}),
        (experts, {"tp": "etp", "ep": "ep", "dp": "edp"}),
    ):
        for token, ours in names.items():
            groups = generator.get_ranks(token)
            assert sorted(r for g in groups for r in g) == list(range(layout.world))
            for group in groups:
                assert [coords[rank][ours] for rank in group] == list(range(len(group))), (token, group)


# -- the command -----------------------------------------------------------------------------------
runner = CliRunner()


def test_the_console_shows_every_command_line_whole() -> None:
    result = runner.invoke(app, ["run", "--dry-run", str(CPU_STACK)])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    plan = json.loads(runner.invoke(app, ["run", "--dry-run", "--json", str(CPU_STACK)]).stdout)
    assert [p["name"] for p in plan["processes"]] == [
        "driver", "sglang-engine-0", "sglang-engine-1", "sglang-router", "trainer-rank-1",
    ]  # fmt: skip
    for process in plan["processes"]:
        assert " ".join(shlex.join(process["argv"]).split()) in shown
        assert all(f"{key}={value}" in shown for key, value in process["env"].items())
    assert "Megatron layout: 2 ranks = tp 2 x pp 1 x dp 1" in shown
    assert all(" ".join(note.split()) in shown for note in plan["notes"])


def test_a_bad_layout_is_a_clear_error_with_exit_2(tmp_path: Path) -> None:
    options = {"tp": 4, "pp": 1, "dp": 1, "ep": 8, "etp": 1}  # 4 ranks cannot hold 8 expert-parallel ranks
    result = runner.invoke(
        app, ["run", "--dry-run", str(write_config(tmp_path, REFERENCE, {"trainer": {"options": options}}))]
    )
    assert result.exit_code == 2
    assert "world size 4" in result.output and "must be a multiple of ep" in " ".join(result.output.split())
    # with the model's config.json here, its shape is checked too
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({**QWEN3_30B_A3B, "model_type": "qwen3_moe", "torch_dtype": "bfloat16"})
    )
    fits = write_config(tmp_path, REFERENCE, {"model": {"path": str(model)}})
    result = runner.invoke(app, ["run", "--dry-run", str(fits)])
    assert result.exit_code == 0 and "splits as the layout needs" in result.output, result.output
    options = {"tp": 3, "pp": 1, "dp": 2, "ep": 2, "etp": 1}  # 6 ranks split fine, 32 heads do not split by 3
    bad = write_config(tmp_path, REFERENCE, {"model": {"path": str(model)}, "trainer": {"options": options}})
    result = runner.invoke(app, ["run", "--dry-run", str(bad)])
    assert (
        result.exit_code == 2 and "num_attention_heads=32 is not divisible by tensor parallel size 3" in result.output
    )
    result = runner.invoke(app, ["run", "--json", str(fits)])
    assert result.exit_code == 2 and "add --dry-run" in result.output


# -- nothing starts --------------------------------------------------------------------------------
AUDITED = textwrap.dedent(
    """
    import json, socket, subprocess, sys

    WATCHED = ("subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
               "socket.bind", "socket.connect", "pty.spawn")
    seen = []
    sys.addaudithook(lambda event, args: seen.append([event, repr(args)[:300]]) if event.startswith(WATCHED) else None)
    try:
        if sys.argv[1] == "--control":  # what the hook must catch
            subprocess.run(["true"])
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
        else:
            from patchgym.cli import app
            app(sys.argv[1:], prog_name="patchgym")
    finally:
        print("AUDIT " + json.dumps(seen), file=sys.stderr)
    """
)
"""Runs `patchgym ARGS` with a Python audit hook that records every process start and socket bind or connect."""


def audited(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", AUDITED, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=SUBPROCESS_BOUND_S,
    )
    line = [x for x in done.stderr.splitlines() if x.startswith("AUDIT ")]
    assert line, done.stderr[-3000:]
    return done, json.loads(line[-1].removeprefix("AUDIT "))


def test_dry_run_starts_no_process_and_binds_no_port(tmp_path: Path) -> None:
    """No process starts, no socket is bound or connected, no venv is built and no run directory is made,
    for the CPU stack (its SGLang venv not built yet) and for the GPU reference on this CPU machine."""
    _, control = audited(tmp_path, "--control")
    assert {event for event, _ in control} >= {"subprocess.Popen", "socket.bind"}
    done, seen = audited(tmp_path, "run", "--dry-run", str(CPU_STACK))
    assert done.returncode == 0 and seen == [], (seen, done.stdout[-2000:], done.stderr[-2000:])
    assert "the CPU SGLang venv is not built yet" in done.stdout and str(tmp_path / "cache") in done.stdout
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()
    done, seen = audited(tmp_path, "run", "--dry-run", "--json", str(REFERENCE))
    assert done.returncode == 0 and seen == [], (seen, done.stderr[-2000:])
    assert len(json.loads(done.stdout)["processes"]) == 1 + 24 + 1 + 8
