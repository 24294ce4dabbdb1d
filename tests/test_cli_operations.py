"""Operator commands driven end to end without their heavy parts: `sandbox reap` on sandboxes of this
test's own label, `sandbox build-base` up to a stand-in debootstrap, `engine launch sglang --gpus` with a
stand-in server that records how it was started."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from patchgym.cli import app
from patchgym.core.sandbox import SandboxBackend, SandboxSpec
from tests.conftest import make_backend

runner = CliRunner()


def unique_label() -> tuple[str, str]:
    """A label no other run on this machine carries (other engineers' sandboxes are live)."""
    return "patchgym-test-reap", "r" + uuid.uuid4().hex


@pytest.mark.parametrize("kind", ["local-none", "docker"])
async def test_reap_removes_exactly_the_sandboxes_with_the_given_labels(
    kind: str, tmp_path: Path, workspace: Path
) -> None:
    backend: SandboxBackend = make_backend(kind, tmp_path)
    key, mine = unique_label()
    _, other = unique_label()
    leaked = [await backend.create(SandboxSpec(workspace=workspace, labels={key: mine})) for _ in range(2)]
    kept = await backend.create(SandboxSpec(workspace=workspace, labels={key: other}))
    try:
        command = ["sandbox", "reap", "--sandbox", kind.split("-")[0], "--label", f"{key}={mine}"]
        if kind == "local-none":
            command += ["--sandbox-option", f"root_dir={tmp_path / 'sandboxes'}"]
        result = await asyncio.to_thread(runner.invoke, app, command)  # the command runs its own event loop
        assert result.exit_code == 0, result.output
        assert "removed 2 sandboxes" in result.output
        assert (await kept.exec("echo still here", timeout_s=60)).stdout == "still here\n"
        again = await asyncio.to_thread(runner.invoke, app, command)
        assert again.exit_code == 0 and "removed 0 sandboxes" in again.output
    finally:
        for box in [*leaked, kept]:
            await box.close()
        await backend.reap({key: other})
        await backend.aclose()


def test_reap_refuses_a_malformed_label() -> None:
    result = runner.invoke(app, ["sandbox", "reap", "--sandbox", "local", "--label", "no-equals-sign"])
    assert result.exit_code != 0 and "expected KEY=VALUE" in result.output


FAKE_DEBOOTSTRAP = """#!/bin/sh
# records its arguments, then makes a one-file root file system where debootstrap would make Debian
printf '%s\\n' "$@" > "$PATCHGYM_TEST_RECORD/debootstrap-args"
[ "$FAIL" = 1 ] && { echo "stand-in debootstrap: told to fail" >&2; exit 3; }
mkdir -p "$4/etc" && echo patchgym-test > "$4/etc/hostname"  # --variant --include SUITE TARGET [MIRROR]
"""


@pytest.fixture
def fake_debootstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "debootstrap").write_text(FAKE_DEBOOTSTRAP)
    (bin_dir / "debootstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PATCHGYM_TEST_RECORD", str(tmp_path))
    return tmp_path / "debootstrap-args"


def docker_errors() -> type[Exception]:
    import docker.errors

    return docker.errors.DockerException


def docker_client():  # type: ignore[no-untyped-def]
    """A Docker client, if an engine is reachable (in CI it must be)."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
        return client
    except Exception as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Docker must be reachable in CI: {exc}")
        pytest.skip(f"no Docker engine is reachable ({exc})")


@pytest.mark.skipif(os.geteuid() != 0, reason="build-base runs debootstrap as root")
def test_build_base_passes_suite_mirror_python_packages_and_tag_to_the_build(fake_debootstrap: Path) -> None:
    client = docker_client()
    tag = f"patchgym-test-base-{uuid.uuid4().hex[:12]}:t1"
    mirror = "http://127.0.0.1:9/debian"
    try:
        options = ["--tag", tag, "--suite", "bullseye", "--mirror", mirror, "--python", "python3.9"]
        result = runner.invoke(app, ["sandbox", "build-base", *options, "--package", "make", "--package", "curl"])
        assert result.exit_code == 0, result.output
        assert f"built {tag}" in result.output
        variant, include, suite, root, given_mirror = fake_debootstrap.read_text().splitlines()
        assert (variant, suite, given_mirror) == ("--variant=minbase", "bullseye", mirror)
        included = set(include.removeprefix("--include=").split(","))
        assert include.startswith("--include=") and {"python3.9", "git", "patch", "make", "curl"} <= included
        assert "python3" not in included
        image = client.images.get(tag)
        assert image.attrs["Config"]["Env"] == ["LANG=C.UTF-8"] or "LANG=C.UTF-8" in image.attrs["Config"]["Env"]
    finally:
        with contextlib.suppress(docker_errors()):
            client.images.remove(tag, force=True)
        client.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="build-base runs debootstrap as root")
def test_build_base_reports_a_failed_debootstrap(fake_debootstrap: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docker_client().close()
    monkeypatch.setenv("FAIL", "1")
    result = runner.invoke(app, ["sandbox", "build-base", "--tag", "patchgym-test-never:built", "--suite", "sid"])
    assert result.exit_code != 0
    assert "debootstrap failed (exit 3)" in result.output and "told to fail" in result.output
    assert fake_debootstrap.read_text().splitlines()[2] == "sid"  # no mirror given: debootstrap's own


FAKE_SGLANG = """
import http.server, json, os, sys

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SGLANG_USE_CPU_ENGINE")}
with open(os.path.join(os.environ["PATCHGYM_TEST_RECORD"], f"{port}.json"), "w") as f:
    json.dump({"argv": argv, "env": env}, f)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.server.answered = self.path == "/health"

    def log_message(self, *args):
        pass


server = http.server.HTTPServer(("127.0.0.1", port), Health)
server.answered = False
while not server.answered:  # healthy once, then gone: the launcher notices the engine exited
    server.handle_request()
"""


def two_free_ports() -> int:
    """A port P with P and P + 1 free on 127.0.0.1, below the ephemeral range (where the launcher's
    own health checks could take P + 1 as a source port)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, low - 1)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n{FAKE_SGLANG}")
    python.chmod(0o755)
    monkeypatch.setenv("PATCHGYM_TEST_RECORD", str(tmp_path))
    yield python


def test_engine_launch_starts_one_server_per_gpu(fake_sglang: Path, tmp_path: Path, tiny_dir: Path) -> None:
    port = two_free_ports()
    command = ["engine", "launch", "sglang", str(tiny_dir), "--python", str(fake_sglang), "--gpus", "2,5"]
    command += ["--port", str(port), "--mem-fraction", "0.7", "--context-length", "4096"]
    command += ["--log-dir", str(tmp_path / "logs"), "--health-timeout", "120"]
    result = runner.invoke(app, command)
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert f"urls={','.join(urls)}" in result.output, result.output
    assert all(f"healthy {url}" in result.output for url in urls)
    assert result.exit_code == 1 and "engine exited" in result.output  # the stand-ins stop after /health
    for offset, gpu in enumerate((2, 5)):
        started = json.loads((tmp_path / f"{port + offset}.json").read_text())
        argv = started["argv"]
        flags = dict(zip(argv[2::2], argv[3::2], strict=False))
        assert argv[:2] == ["-m", "sglang.launch_server"]
        assert flags["--base-gpu-id"] == str(gpu) and flags["--port"] == str(port + offset)
        assert flags["--model-path"] == str(tiny_dir.resolve()) and flags["--host"] == "127.0.0.1"
        assert flags["--mem-fraction-static"] == "0.7" and "--device" not in flags
        assert int(flags["--context-length"]) >= 4096
        assert started["env"] == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_USE_CPU_ENGINE": None}
        assert (tmp_path / "logs" / f"sglang-{port + offset}.log").exists()


def test_engine_launch_refuses_an_empty_gpu_list(fake_sglang: Path, tmp_path: Path, tiny_dir: Path) -> None:
    result = runner.invoke(
        app, ["engine", "launch", "sglang", str(tiny_dir), "--python", str(fake_sglang), "--gpus", ","]
    )
    assert result.exit_code == 2 and "gpus must name at least one device" in result.output


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    """A model directory as the launcher sees it (it only passes the path on)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model
