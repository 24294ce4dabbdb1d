"""Stopping the servers a run starts, and everything they started; the environment each one gets."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from patchgym.launch.plan import ProcessPlan, Where
from patchgym.launch.processes import Child, Supervisor
from tests.test_launch import alive, wait_gone

BOUND_S = 300.0
"""How long a started Python process may take to print its first line on a busy machine."""


def server(on_term: str, worker_on_term: str = "ignore") -> list[str]:
    """A server that starts a worker in its own process group, prints both pids, and waits;
    `on_term` / `worker_on_term`: what each does with SIGTERM ("ignore" or "exit")."""
    code = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys, time
        def handler(kind, name):
            if kind == "ignore":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            else:
                signal.signal(signal.SIGTERM, lambda *_: (print(name, "got SIGTERM", flush=True), os._exit(0)))
        handler({on_term!r}, "server")
        worker = subprocess.Popen([sys.executable, "-c", '''
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN) if {worker_on_term!r} == "ignore" else None
        print("worker up", flush=True)
        time.sleep(3600)
        '''])
        time.sleep(0.2)
        print("pids", os.getpid(), worker.pid, flush=True)
        time.sleep(3600)
        """
    )
    return [sys.executable, "-c", code]


def pids(child: Child) -> tuple[int, int]:
    """The server's and its worker's pids, once the server has printed them."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        for line in child.log_path.read_text().splitlines():
            if line.startswith("pids "):
                server_pid, worker_pid = map(int, line.split()[1:])
                return server_pid, worker_pid
        time.sleep(0.05)
    raise AssertionError(f"{child.name} did not start: {child.log_tail()}")


@pytest.mark.parametrize("on_term", ["ignore", "exit"])
def test_stop_kills_a_server_and_the_workers_it_started_even_when_they_ignore_sigterm(
    tmp_path: Path, on_term: str
) -> None:
    """A server that ignores SIGTERM is killed after the grace time; one that exits on it may leave
    a worker behind that ignores it: the worker is killed with the server's group either way."""
    supervisor = Supervisor(tmp_path, stop_grace_s=0.5)
    child = supervisor.start("server", server(on_term))
    try:
        server_pid, worker_pid = pids(child)
        assert server_pid == child.pid and alive(worker_pid)
    finally:
        supervisor.stop()
    assert child.process.returncode == (0 if on_term == "exit" else -9)
    assert wait_gone([worker_pid]) == []


def test_stop_asks_politely_first(tmp_path: Path) -> None:
    """SIGTERM first, and a server that exits on it within the grace time is not killed."""
    supervisor = Supervisor(tmp_path, stop_grace_s=BOUND_S)
    child = supervisor.start("server", server("exit", worker_on_term="exit"))
    try:
        _, worker_pid = pids(child)
    finally:
        supervisor.stop()
    assert child.process.returncode == 0
    assert "server got SIGTERM" in child.log_path.read_text()
    assert wait_gone([worker_pid]) == []


def test_stopping_some_children_keeps_watching_the_others(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_grace_s=0.5)
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    first, second = supervisor.start("first", sleeper), supervisor.start("second", sleeper)
    try:
        supervisor.stop([first])
        assert first.process.returncode is not None and second.process.poll() is None
        assert supervisor.children == [second]
        recorded = json.loads((tmp_path / "processes.json").read_text())["children"]
        assert [c["name"] for c in recorded] == ["second"]
        second.process.kill()
        second.process.wait()
        assert supervisor.dead() == [second]  # a death after a partial stop is still a death
    finally:
        supervisor.stop()
    assert supervisor.dead() == []


def test_a_plans_variables_win_over_the_inherited_ones_and_reach_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = ProcessPlan("engine", "engine", Where(), ("x",), env={"OMP_NUM_THREADS": "3", "SHARED": "plan"})
    base = {"SHARED": "inherited", "ONLY_INHERITED": "1"}
    assert plan.environ(base) == {"SHARED": "plan", "ONLY_INHERITED": "1", "OMP_NUM_THREADS": "3"}
    assert ProcessPlan("router", "router", Where(), ("x",)).environ(base) is None  # inherit unchanged
    monkeypatch.setenv("SHARED", "inherited")
    monkeypatch.setenv("PATCHGYM_TEST_INHERITED", "yes")
    environ = plan.environ()
    assert environ is not None and environ["PATCHGYM_TEST_INHERITED"] == "yes" and environ["SHARED"] == "plan"

    supervisor = Supervisor(tmp_path, stop_grace_s=5)
    names = ["SHARED", "OMP_NUM_THREADS", "PATCHGYM_TEST_INHERITED"]
    show = f"import os; print(*(os.environ[n] for n in {names!r}))"
    child = supervisor.start("show", [sys.executable, "-c", show], environ)
    try:
        child.process.wait(BOUND_S)
    finally:
        supervisor.stop()
    assert child.log_path.read_text().split() == ["plan", "3", "yes"]
    assert os.environ["SHARED"] == "inherited"  # the plan does not change the driver's own environment
