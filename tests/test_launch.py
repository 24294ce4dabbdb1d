"""patchgym.launch: child processes, the sglang factory, the watchdog, and Megatron ranks the pipeline starts.

The SGLang engine group itself (servers, router, distributed sync, kill tests) is in
tests/test_production_stack.py; these run without SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchgym.core.errors import ConfigError
from patchgym.core.metrics import read_events
from patchgym.core.plugins import registry
from patchgym.launch.engines import EngineLaunch, engine_runtime, free_port, plan_group, router_command
from patchgym.launch.lifecycle import close_parts, watched
from patchgym.launch.processes import ProcessDiedError, Supervisor
from patchgym.launch.ranks import RankSpec, Rendezvous, plan_ranks
from patchgym.launch.sync import resolve_mode
from tests.pipeline_support import check_grpo_accounting, run_config

ROOT = Path(__file__).resolve().parent.parent
STOP_BOUND_S = 120.0
"""How long a stopped run may take to be gone with everything it started (generous: a busy 2-core CI)."""


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def recorded_pids(run_dir: Path) -> list[int]:
    """Every child pid a run recorded (RUN_DIR/logs/*/processes.json)."""
    pids = []
    for record in Path(run_dir, "logs").glob("*/processes.json"):
        pids += [child["pid"] for child in json.loads(record.read_text())["children"]]
    return pids


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (read from /proc), so that workers a server forked are counted too."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def wait_gone(pids: set[int] | list[int], bound_s: float = STOP_BOUND_S) -> list[int]:
    """Wait until none of `pids` is alive; those still alive after `bound_s`."""
    deadline = time.monotonic() + bound_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def wait_for_event(run_dir: Path, kind: str, process: subprocess.Popen, bound_s: float = 1800.0) -> dict[str, Any]:
    """The first `kind` event the running `process` logs (it must not exit first)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if (Path(run_dir) / "events.jsonl").exists():
            events = read_events(run_dir, kind)
            if events:
                return events[0]
        assert process.poll() is None, f"the run exited ({process.returncode}) before a {kind} event"
        time.sleep(0.5)
    raise AssertionError(f"no {kind} event within {bound_s:.0f} s")


def patchgym_run(*args: str, log: Path) -> subprocess.Popen:
    """`patchgym run ...` in its own process, output to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "patchgym.cli", "run", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            # a shell that started these tests in the background made them ignore SIGINT, and children inherit that
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def kill_quietly(process: subprocess.Popen) -> None:
    """Stop a run a test started, and everything below it, whatever state the test left it in."""
    below = descendants(process.pid)
    if process.poll() is None:
        process.kill()
    process.wait()
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- pure pieces ---------------------------------------------------------------------------------
def test_router_command_binds_loopback_with_the_policy() -> None:
    command = router_command(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"], 7000, "round_robin", metrics_port=7001, python="py"
    )
    assert command[:3] == ["py", "-m", "sglang_router.launch_router"]
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "7000"
    workers = command.index("--worker-urls")
    assert command[workers + 1 : workers + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert command[command.index("--policy") + 1] == "round_robin"
    assert command[command.index("--prometheus-host") + 1] == "127.0.0.1"
    assert command[command.index("--prometheus-port") + 1] == "7001"


def test_cache_aware_router_balances_by_default_and_takes_more_flags(tmp_path: Path) -> None:
    """The router's own balance (64 requests apart) left one engine of two idle at a rollout
    concurrency of 32: cache_aware gets patchgym's thresholds; router_options override and add flags."""
    launch = EngineLaunch(engines=2, python="/opt/sgl/bin/python")
    runtime = engine_runtime(launch, build=False)

    def router_argv(policy: str, options: dict | None = None) -> list[str]:
        plan = plan_group(
            tmp_path, launch, max_context=64, router=policy, runtime=runtime, router_options=options
        )  # fmt: skip
        (router,) = [p for p in plan.processes if p.role == "router"]
        return list(router.argv)

    def flag(argv: list[str], name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    default = router_argv("cache_aware")
    assert flag(default, "--balance-abs-threshold") == "2" and flag(default, "--balance-rel-threshold") == "1.2"
    custom = router_argv("cache_aware", {"balance_abs_threshold": 16, "cache_threshold": 0.5})
    assert flag(custom, "--balance-abs-threshold") == "16" and flag(custom, "--cache-threshold") == "0.5"
    assert flag(custom, "--balance-rel-threshold") == "1.2"
    assert flag(router_argv("round_robin"), "--balance-abs-threshold") is None


def test_processes_on_one_machine_split_its_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CPU engines (and two trainer ranks) each took every core: their thread barriers spun against
    each other and decoding was 10x slower. By default each gets cores / processes threads, at least 1."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for engines, given, threads in ((2, None, "4"), (16, None, "1"), (2, 3, "3")):
        launch = EngineLaunch(engines=engines, cpu_venv=True, cpu_threads=given)
        plan = plan_group(
            tmp_path, launch, max_context=64, router="none", runtime=engine_runtime(launch, build=False)
        )  # fmt: skip
        assert {p.env.get("OMP_NUM_THREADS") for p in plan.processes} == {threads}
    gpu = EngineLaunch(engines=2, python="/opt/sgl/bin/python")
    plan = plan_group(tmp_path, gpu, max_context=64, router="none", runtime=engine_runtime(gpu, build=False))
    assert all("OMP_NUM_THREADS" not in p.env for p in plan.processes)  # GPU servers: SGLang's own choice
    ranks = plan_ranks(tmp_path, ports=free_port, world=None, tp=2, dp=2)
    assert ranks.trainer_options["threads"] == 2 and all(f.options["threads"] == 2 for f in ranks.followers)
    assert plan_ranks(tmp_path, ports=free_port, world=None, tp=2, threads=1).trainer_options["threads"] == 1


def test_engine_group_plan_gives_each_server_its_port_gpus_and_ranks(tmp_path: Path) -> None:
    launch = EngineLaunch(engines=2, tp=2, python="/opt/sgl/bin/python", extra_args=["--foo"], env={"X": "1"})
    runtime = engine_runtime(launch, build=False)
    plan = plan_group(tmp_path, launch, max_context=1024, router="cache_aware", runtime=runtime)
    engines = [p for p in plan.processes if p.role == "engine"]
    commands = [list(p.argv) for p in engines]
    ports = [c[c.index("--port") + 1] for c in commands]
    assert len(set(ports)) == 2 and list(plan.engine_urls) == [f"http://127.0.0.1:{p}" for p in ports]
    assert [c[c.index("--base-gpu-id") + 1] for c in commands] == ["0", "2"]
    assert [p.where.gpus for p in engines] == [(0, 1), (2, 3)]
    assert all(c[0] == "/opt/sgl/bin/python" for c in commands)
    assert all(c[c.index("--tp-size") + 1] == "2" and c[-1] == "--foo" for c in commands)
    assert all(c[c.index("--host") + 1] == "127.0.0.1" for c in commands)
    assert all(p.env["X"] == "1" and p.env["HF_HUB_OFFLINE"] == "1" for p in engines)
    router = plan.processes[-1]
    assert router.role == "router" and "cache_aware" in router.argv and router.url == plan.router_url
    assert plan.router_url is not None and plan.router_url.startswith("http://127.0.0.1:")
    no_router = plan_group(tmp_path, launch, max_context=1024, router="none", runtime=runtime)
    assert no_router.router_url is None and all(p.role == "engine" for p in no_router.processes)
    with pytest.raises(ConfigError, match="need 8 GPUs"):
        plan_group(
            tmp_path, EngineLaunch(engines=4, tp=2, gpus=[0, 1]), max_context=1024, router="none", runtime=runtime
        )


def test_each_rank_gets_its_own_gpu_and_the_weight_group_the_trainers_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path, checked without a GPU: follower rank r is started with LOCAL_RANK=r; a rank binds
    GPU LOCAL_RANK (else its rank) modulo the GPUs it sees; the weight group takes NCCL when the
    trainer's tensors are on a GPU, whatever the driver has."""
    torch = pytest.importorskip("torch")
    from patchgym.backends.trainer.megatron import bind_device
    from patchgym.launch.ranks import rank_process
    from patchgym.launch.sync import group_backend

    ranks = plan_ranks(tmp_path, ports=free_port, world=None, tp=2, dp=2)
    assert [rank_process(f).env["LOCAL_RANK"] for f in ranks.followers] == ["1", "2", "3"]
    assert bind_device(3) == torch.device("cpu")  # no GPU here
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert bind_device(2) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert bind_device(0) == torch.device("cuda", 1) and chosen == [0, 1]
    assert group_backend({"device": "cuda:1"}) == "nccl"
    assert group_backend({"device": "cpu"}) == group_backend({}) == "gloo"


def test_rank_spec_round_trips() -> None:
    spec = RankSpec(Rendezvous("127.0.0.1", 29500, 4), 3, "/m", {"tp": 2, "lr": 1e-3}, 30.0)
    assert RankSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError):
        Rendezvous("127.0.0.1", 0, 2)


async def test_sglang_attaches_by_urls_with_the_pipelines_model_option() -> None:
    """`patchgym run` passes model=...; attaching by urls used to fail on it."""
    engine = registry().create("inference", "sglang", model="/m", urls=["http://127.0.0.1:9/"], max_context=1024)
    try:
        assert engine.urls == ["http://127.0.0.1:9"] and engine.router_url is None and engine.supervisor is None
        assert engine.settings()["max_context"] == 1024
    finally:
        await engine.aclose()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_context": 8}, "either urls"),
        ({"urls": ["http://127.0.0.1:9"], "launch": {"engines": 1}, "max_context": 8}, "either urls"),
        ({"urls": ["http://127.0.0.1:9"], "router": "fastest", "max_context": 8}, "router must be one of"),
        ({"urls": ["http://127.0.0.1:9"], "max_context": 8, "bogus": 1}, "invalid sglang client settings"),
        ({"urls": ["http://127.0.0.1:9"]}, "invalid sglang client settings.*max_context"),
        ({"launch": {"engines": 0}, "max_context": 8}, "invalid sglang launch settings: engines"),
        ({"launch": {"engine": 2}, "max_context": 8}, "invalid sglang launch settings: engine"),
    ],
)
def test_sglang_options_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        registry().create("inference", "sglang", model="/m", **options)


def test_sync_mode_auto_follows_where_the_engine_runs() -> None:
    class InProcess:
        pass

    class Remote:
        out_of_process = True

    assert resolve_mode("auto", InProcess()) == "tensor" and resolve_mode("auto", Remote()) == "distributed"
    assert resolve_mode("disk", InProcess()) == "disk" and resolve_mode("tensor", Remote()) == "tensor"
    with pytest.raises(ConfigError, match="distributed needs engines in other processes"):
        resolve_mode("distributed", InProcess())


# -- processes -----------------------------------------------------------------------------------
def test_supervisor_reports_a_dead_child_then_stops_the_rest(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_grace_s=5)
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(3600)"]
    first, second = supervisor.start("first", sleeper), supervisor.start("second", sleeper)
    try:
        records = json.loads((tmp_path / "processes.json").read_text())
        assert [c["pid"] for c in records["children"]] == [first.pid, second.pid]
        supervisor.check()
        os.kill(first.pid, signal.SIGKILL)
        first.process.wait()
        with pytest.raises(ProcessDiedError, match=r"first \(pid \d+\) exited \(killed by signal 9\)"):
            supervisor.check()
    finally:
        supervisor.stop()
    assert second.process.returncode is not None and not alive(second.pid)
    assert supervisor.dead() == []  # stopping on purpose is not a death


def test_children_die_with_a_sigkilled_driver(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a driver killed with SIGKILL (no clean-up runs) leaves no child behind."""
    driver = textwrap.dedent(
        f"""
        import sys, time
        from patchgym.launch.processes import Supervisor
        supervisor = Supervisor({str(tmp_path)!r})
        child = supervisor.start("sleeper", [sys.executable, "-c", "import time; time.sleep(3600)"])
        print(child.pid, flush=True)
        time.sleep(3600)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        child = int(process.stdout.readline())  # type: ignore[union-attr]
        assert alive(child)
        process.kill()
        process.wait()
        assert wait_gone([child]) == []
    finally:
        kill_quietly(process)


async def test_watched_stops_the_block_when_a_part_dies_and_closes_every_part() -> None:
    class Part:
        def __init__(self) -> None:
            self.problem: str | None = None
            self.closed = False

        def fatal(self) -> str | None:
            return self.problem

        async def aclose(self) -> None:
            self.closed = True
            if self is broken:
                raise RuntimeError("close failed")

    healthy, dying, broken = Part(), Part(), Part()

    async def die_later() -> None:
        await asyncio.sleep(0)
        dying.problem = "trainer-rank-1 (pid 1) exited with killed by signal 9"

    with pytest.raises(ProcessDiedError, match="the run stopped: trainer-rank-1"):
        async with watched([healthy, dying], poll_s=0.01):
            asyncio.ensure_future(die_later())
            await asyncio.Event().wait()  # blocked for good: only the watchdog ends this
    with pytest.raises(RuntimeError, match="close failed"):
        await close_parts([broken, None, healthy])
    assert healthy.closed and broken.closed


# -- Megatron ranks started by the pipeline ------------------------------------------------------
def megatron_config(tmp_path: Path, steps: int) -> Path:
    trainer = {"name": "megatron", "options": {"tp": 2, "lr": 1e-3, "micro_batch_tokens": 2048, "timeout_s": 300}}
    config = run_config(tmp_path, steps=steps, changes={"trainer": trainer, "metrics": {"tensorboard": False}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.usefixtures("train_extra")
@pytest.mark.timeout(1800)
def test_trainer_rank_killed_mid_grpo_stops_the_run_then_torchrun_resumes_it(tmp_path: Path) -> None:
    """Megatron TP=2 with the second rank started by `patchgym run`: SIGKILL it mid-GRPO, the run
    stops with an error naming it (not a hang), nothing is left; `torchrun ... --resume` finishes."""
    pytest.importorskip("megatron.core")
    steps = 4
    config = megatron_config(tmp_path, steps)
    run_dir = tmp_path / "run"
    process = patchgym_run(str(config), log=tmp_path / "first.log")
    try:
        wait_for_event(run_dir, "step", process)
        (rank1,) = [c for c in json.loads((run_dir / "logs/trainer/processes.json").read_text())["children"]]
        assert rank1["name"] == "trainer-rank-1"
        os.kill(rank1["pid"], signal.SIGKILL)
        process.wait(STOP_BOUND_S)
    finally:
        kill_quietly(process)
    output = (tmp_path / "first.log").read_text()
    assert process.returncode != 0, output[-3000:]
    assert "trainer-rank-1" in output and "signal 9" in output, output[-3000:]
    assert wait_gone(recorded_pids(run_dir)) == []
    assert json.loads((run_dir / "state.json").read_text())["grpo_step"] < steps

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={free_port()}", "-m", "patchgym.cli", "run", "--resume", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    resumed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1500)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    check_grpo_accounting(run_dir, steps=steps)
    launches = read_events(run_dir, "launch")
    assert [e["trainer"]["ranks_started_by"] for e in launches] == ["patchgym", "launcher"]


async def test_client_side_balancing_skips_an_engine_whose_server_died(tmp_path: Path) -> None:
    """router: none: generation avoids a started engine that exited; a dead router or all engines is fatal."""
    from patchgym.backends.inference.sglang import SGLangEngine

    supervisor = Supervisor(tmp_path, stop_grace_s=5)
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    children = [supervisor.start(f"sglang-engine-{i}", sleeper) for i in range(2)]
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    engine = SGLangEngine(urls, max_context=64, supervisor=supervisor, retries=0)
    try:
        assert {engine._pick() for _ in range(4)} == set(urls) and engine.fatal() is None
        os.kill(children[1].pid, signal.SIGKILL)
        children[1].process.wait()
        assert engine.dead_urls() == {urls[1]} and {engine._pick() for _ in range(4)} == {urls[0]}
        assert engine.fatal() is None  # one engine left: the run goes on until the next weight sync
        with pytest.raises(ProcessDiedError, match="sglang-engine-1"):
            engine.check_engines()
        # a control call (the weight sync's pause/resume) that fails names the dead server, not the socket
        with pytest.raises(ProcessDiedError, match=r"sglang-engine-1 \(pid \d+\) exited \(killed by signal 9\)"):
            await engine.resume()
        os.kill(children[0].pid, signal.SIGKILL)
        children[0].process.wait()
        assert "every SGLang engine exited" in (engine.fatal() or "")
    finally:
        await engine.aclose()
    assert not any(alive(c.pid) for c in children)


def test_idle_rank_0_pings_its_followers_before_their_wait_times_out() -> None:
    """Followers wait for rank 0's next call inside a collective bounded by timeout_s; during a long
    evaluation rank 0 calls nothing, so it sends a no-op every heartbeat_s (timeout_s / 4)."""
    pytest.importorskip("megatron.core")
    from concurrent.futures import ThreadPoolExecutor
    from threading import Event, Thread
    from types import SimpleNamespace

    from patchgym.backends.trainer.megatron import MegatronTrainer

    pinged = Event()
    rank0 = SimpleNamespace(
        _closed=Event(),
        heartbeat_s=0.05,
        _last_call=time.monotonic(),
        _executor=ThreadPoolExecutor(1),
        _call=lambda command: pinged.set() if command == "ping" else None,
    )
    thread = Thread(target=MegatronTrainer._heartbeat, args=(rank0,))
    thread.start()
    try:
        assert pinged.wait(60)
    finally:
        rank0._closed.set()
        thread.join()
        rank0._executor.shutdown()


async def test_ctrl_c_while_the_ranks_meet_stops_waiting() -> None:
    """`patchgym run` is cancelled by Ctrl-C; rank 0 waiting for followers that never come stops at once."""
    pytest.importorskip("torch")
    from patchgym.launch.ranks import join_watching

    class NoFollowers:
        def check(self) -> None:
            pass

    async def rank0() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]  # as the first Ctrl-C does
        join_watching(Rendezvous("127.0.0.1", free_port(), 2), NoFollowers(), timeout_s=5)  # type: ignore[arg-type]

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(rank0())


@pytest.mark.usefixtures("train_extra")
async def test_disk_weight_sync_exports_each_version_and_keeps_the_newest(tmp_path: Path) -> None:
    """weight_sync: disk with the embedded parts: each version is exported under RUN_DIR/weights and loaded."""
    from rich.console import Console

    from patchgym.pipeline.config import RunConfig
    from patchgym.pipeline.run import Pipeline

    changes = {"weight_sync": "disk", "weight_sync_timeout_s": 42, "metrics": {"tensorboard": False}}
    changes["eval"] = {"limit": 1}
    config = RunConfig.model_validate(run_config(tmp_path, steps=1, sft=False, changes=changes))
    await Pipeline(config, console=Console(quiet=True)).run()
    run_dir = Path(config.run_dir)
    assert read_events(run_dir, "launch")[0]["weight_sync"]["timeout_s"] == 42
    (sync,) = read_events(run_dir, "weight_sync")
    assert sync["mode"] == "disk" and sync["version"] == 1 and sync["groups"] == 0
    assert sync["bytes"] == sum(f.stat().st_size for f in (run_dir / "weights" / "v1").iterdir())
    assert [p.name for p in (run_dir / "weights").iterdir()] == ["v1"]
    reported = {k: v for k, v in sync.items() if k not in ("kind", "time")}
    assert read_events(run_dir, "step")[0]["weight_sync"] == reported
