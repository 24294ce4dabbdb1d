"""SGLang client behaviour a real server cannot be made to show on demand: 5xx, dead engines,
several engines. The stand-in servers speak SGLang's wire format (`/generate` bodies and
`meta_info` as sglang 0.5.23 returns them); everything else is tested in test_sglang.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from patchgym.backends.inference.sglang import SGLangEngine
from patchgym.core.errors import ConfigError, TransportError
from patchgym.core.inference import SamplingParams


class Gate:
    """Holds the next `count` requests (to whichever server shares it) until `open()`."""

    def __init__(self, count: int = 0) -> None:
        self.count, self.lock, self.opened = count, threading.Lock(), threading.Event()

    def take(self) -> bool:
        with self.lock:
            held = self.count > 0
            self.count -= 1 if held else 0
        return held

    def open(self) -> None:
        self.opened.set()


class FakeSGLang(ThreadingHTTPServer):
    """Answers `/generate` like SGLang after `delay_s` (and after its `gate` opens, for a held
    request); the first `fail_first` calls get `fail_status`."""

    daemon_threads = True

    def __init__(
        self,
        delay_s: float = 0.0,
        fail_first: int = 0,
        fail_status: int = 503,
        finish: str = "length",
        gate: Gate | None = None,
    ):
        super().__init__(("127.0.0.1", 0), Handler)
        self.delay_s, self.fail_first, self.fail_status, self.finish = delay_s, fail_first, fail_status, finish
        self.gate = gate or Gate()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.active = self.peak = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeSGLang

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        fake = self.server
        with fake.lock:
            fake.calls.append((self.path, body))
            failing = fake.fail_first > 0
            fake.fail_first -= 1 if failing else 0
            fake.active += 1
            fake.peak = max(fake.peak, fake.active)
        try:
            if failing:
                return self.reply(fake.fail_status, {"error": "overloaded"})
            if self.path == "/generate" and not body.get("input_ids"):
                return self.reply(400, {"error": {"message": "input_ids is empty"}})
            if self.path == "/generate" and fake.gate.take():
                fake.gate.opened.wait(timeout=120)
            time.sleep(fake.delay_s)
            if self.path != "/generate":
                return self.reply(200, None)
            n = body["sampling_params"]["max_new_tokens"]
            tokens = list(range(10, 10 + n))
            meta = {
                "id": body["rid"],
                "finish_reason": {"type": fake.finish, "length": n},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": n,
                "cached_tokens": 0,
                "weight_version": "7",
                "output_token_logprobs": [[-0.5, t, None] for t in tokens],
            }
            self.reply(200, {"text": "", "output_ids": tokens, "meta_info": meta})
        finally:
            with fake.lock:
                fake.active -= 1

    def reply(self, status: int, payload: Any) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(**kwargs: Any) -> Iterator[FakeSGLang]:
    server = FakeSGLang(**kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    yield from serve()


PARAMS = SamplingParams(max_new_tokens=4)


async def test_parses_tokens_logprobs_version_and_sends_the_native_request(fake: FakeSGLang) -> None:
    engine = SGLangEngine(fake.url, max_context=100)
    out = await engine.generate(
        [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.7, stop_token_ids=[9], seed=5)
    )
    await engine.aclose()
    assert (list(out.token_ids), list(out.logprobs)) == ([10, 11, 12, 13], [-0.5] * 4)
    assert (out.finish_reason, out.weight_version) == ("length", 7)
    path, body = fake.calls[0]
    assert path == "/generate" and body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 1.0,
        "stop_token_ids": [9],
        "sampling_seed": 5,
    }


async def test_abort_finish_reason_is_reported_as_abort() -> None:
    for server in serve(finish="abort"):
        engine = SGLangEngine(server.url, max_context=100)
        assert (await engine.generate([1], PARAMS)).finish_reason == "abort"
        await engine.aclose()


async def test_5xx_is_retried_then_succeeds() -> None:
    for server in serve(fail_first=2, fail_status=503):
        engine = SGLangEngine(server.url, max_context=100, retries=3, retry_backoff_s=0.01)
        assert (await engine.generate([1], PARAMS)).finish_reason == "length"
        assert len(server.calls) == 3
        await engine.aclose()


async def test_persistent_5xx_is_a_transport_error_after_bounded_retries() -> None:
    for server in serve(fail_first=100, fail_status=500):
        engine = SGLangEngine(server.url, max_context=100, retries=2, retry_backoff_s=0.01)
        with pytest.raises(TransportError, match="3 attempt"):
            await engine.generate([1], PARAMS)
        assert len(server.calls) == 3
        await engine.aclose()


async def test_dead_engine_is_a_transport_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = SGLangEngine(f"http://127.0.0.1:{port}", max_context=100, retries=1, retry_backoff_s=0.01)
    with pytest.raises(TransportError) as info:
        await engine.generate([1], PARAMS)
    assert info.value.retryable and info.value.kind == "transport"
    assert await engine.health() == {f"http://127.0.0.1:{port}": False}
    await engine.aclose()


async def test_4xx_is_a_config_error_without_retry(fake: FakeSGLang) -> None:
    engine = SGLangEngine(fake.url, max_context=100)
    with pytest.raises(ConfigError, match="input_ids is empty"):
        await engine.generate([], PARAMS)
    assert len(fake.calls) == 1
    await engine.aclose()


async def wait_until(condition: Callable[[], bool], deadline_s: float = 60.0) -> None:
    """Let the event loop run until `condition` holds; fail after a deadline generous for a loaded machine."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while not condition():
        assert loop.time() < give_up, f"the state was not reached within {deadline_s} s"
        await asyncio.sleep(0.01)


async def test_least_outstanding_requests_balancing() -> None:
    gate = Gate(count=1)  # the first request is held wherever it lands, until the gate opens
    one, other = serve(gate=gate), serve(gate=gate)
    servers = [next(one), next(other)]
    engine = SGLangEngine([s.url for s in servers], max_context=100)
    first = asyncio.create_task(engine.generate([1], PARAMS))
    await wait_until(lambda: any(s.active for s in servers))
    busy, idle = servers if servers[0].active else servers[::-1]
    for _ in range(5):  # one at a time: each goes to the idle engine, never the busy one
        await engine.generate([2], PARAMS)
    assert (len(busy.calls), len(idle.calls)) == (1, 5), "requests went to the busy engine"
    gate.open()
    await first
    assert busy.calls[0][1]["input_ids"] == [1]
    assert engine.outstanding == {s.url: 0 for s in servers}
    await asyncio.gather(*(engine.generate([3], PARAMS) for _ in range(10)))
    assert len(busy.calls) + len(idle.calls) == 16
    await engine.aclose()
    for gen in (one, other):
        next(gen, None)


async def test_connection_pool_is_sized_to_concurrency() -> None:
    for server in serve(delay_s=0.2):
        engine = SGLangEngine(server.url, max_context=100, concurrency=2)
        await asyncio.gather(*(engine.generate([1], PARAMS) for _ in range(6)))
        assert server.peak == 2
        assert engine.settings()["concurrency"] == 2
        await engine.aclose()


async def test_cancelled_generate_aborts_its_request() -> None:
    gate = Gate(count=1)
    running = serve(gate=gate)
    fake = next(running)
    engine = SGLangEngine(fake.url, max_context=100)
    task = asyncio.create_task(engine.generate([1], PARAMS, request_id="r-1"))
    await wait_until(lambda: fake.active == 1)  # the request is at the server
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ("/abort_request", {"rid": "r-1"}) in fake.calls
    gate.open()
    await engine.aclose()
    next(running, None)


def test_weight_buckets_keep_order_and_cap_bytes() -> None:
    from patchgym.backends.inference.weight_group import split_buckets

    sizes = {"a": 4, "b": 4, "c": 4, "big": 10, "e": 1}
    assert split_buckets(sizes, 8) == [["a", "b"], ["c"], ["big"], ["e"]]  # a tensor over the cap goes alone
    assert split_buckets(sizes, 12) == [["a", "b", "c"], ["big", "e"]]  # a bucket may fill exactly
    assert split_buckets(sizes, 1 << 30) == [list(sizes)]
    assert split_buckets({}, 8) == []
    with pytest.raises(ConfigError, match="bucket_bytes"):
        split_buckets(sizes, 0)
    engine = SGLangEngine("http://127.0.0.1:1", max_context=10, weight_bucket_bytes=1024)
    assert engine.settings()["weight_bucket_bytes"] == 1024


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="at least one engine URL"):
        SGLangEngine([], max_context=10)
    with pytest.raises(ConfigError, match="weight_bucket_bytes"):
        SGLangEngine("http://127.0.0.1:1", max_context=10, weight_bucket_bytes=0)
    with pytest.raises(ConfigError, match="pause_mode"):
        SGLangEngine("http://127.0.0.1:1", max_context=10, pause_mode="later")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ignore_eos"):
        engine = SGLangEngine("http://127.0.0.1:1", max_context=10, ignore_eos=True)
        asyncio.run(engine.generate([1], SamplingParams(max_new_tokens=2, stop_token_ids=[3])))


def test_registered_as_inference_backend(fake: FakeSGLang) -> None:
    from patchgym.core.plugins import registry

    engine = registry().create("inference", "sglang", urls=fake.url, max_context=64)
    assert isinstance(engine, SGLangEngine) and engine.max_context == 64


def test_launch_command_flags(tmp_path: Any) -> None:
    from patchgym.backends.inference.sglang_launch import (
        SERVER_CONTEXT_HEADROOM,
        SGLangLaunchSettings,
        server_command,
        server_env,
    )

    gpu = SGLangLaunchSettings(model_path=tmp_path, gpus=(2, 3), base_port=31000, context_length=8192)
    commands = [server_command(gpu, i) for i in range(2)]
    for index, cmd in enumerate(commands):
        flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
        assert flags["--port"] == str(31000 + index) and flags["--base-gpu-id"] == str(2 + index)
        assert flags["--context-length"] == str(8192 + SERVER_CONTEXT_HEADROOM)
        assert flags["--mem-fraction-static"] == "0.85" and "--device" not in flags
    stubs = tmp_path / "stubs"
    cpu = SGLangLaunchSettings(
        model_path=tmp_path, device="cpu", max_total_tokens=4096, mem_fraction_static=None, stubs_dir=stubs
    )
    cmd = server_command(cpu, 0)
    assert cmd[cmd.index("--device") + 1] == "cpu" and "--disable-cuda-graph" in cmd
    assert cmd[cmd.index("--attention-backend") + 1] == "torch_native"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096" and "--base-gpu-id" not in cmd
    assert server_env(cpu)["PYTHONPATH"].split(":")[0] == str(stubs)
    with pytest.raises(ConfigError, match="max_total_tokens"):
        SGLangLaunchSettings(model_path=tmp_path, device="cpu")
    with pytest.raises(ConfigError, match="device"):
        SGLangLaunchSettings(model_path=tmp_path, device="tpu")


def test_cpu_requirements_drop_cuda_packages(tmp_path: Any) -> None:
    from patchgym.backends.inference.sglang_venv import cpu_requirements

    meta = tmp_path / "sglang-0.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.0\n"
        "Requires-Dist: fastapi\nRequires-Dist: torch==2.14.1\nRequires-Dist: sglang-kernel==0.4.10\n"
        "Requires-Dist: flashinfer_python[cu13]==0.7.2\nRequires-Dist: cuda-python>=13.0\n"
        'Requires-Dist: transformers==5.19.0\nRequires-Dist: pytest; extra == "test"\n'
        'Requires-Dist: decord2; sys_platform == "win32"\n'
    )
    assert cpu_requirements(meta) == ["fastapi", "transformers==5.19.0"]


def test_stub_modules_import_and_refuse_use(tmp_path: Any) -> None:
    import subprocess
    import sys

    from patchgym.backends.inference.sglang_venv import write_stubs

    write_stubs(tmp_path)
    code = (
        "from torchvision.transforms import InterpolationMode\n"
        "from sgl_kernel.flash_attn import flash_attn_varlen_func\n"
        "import sgl_kernel\n"
        "print(InterpolationMode.BICUBIC)\n"
        "try:\n    sgl_kernel.copy_all_layer_kv_cache_cpu(1)\n"
        "except NotImplementedError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}
    )
    assert out.returncode == 0, out.stderr
    assert "InterpolationMode.BICUBIC" in out.stdout and "refused sgl_kernel.copy_all_layer_kv_cache_cpu" in out.stdout


async def test_staged_weight_groups_are_joined_once_and_left_when_replaced(fake: FakeSGLang) -> None:
    """The engine joins a staged sync's group at the first sync, reuses it at the next, and destroys
    it (once) when a sync names other groups, or when it closes."""
    from patchgym.backends.inference.sglang import StagedWeights, WeightGroup

    engine = SGLangEngine(fake.url, max_context=64, ranks_per_engine=[1])
    sent: list[str] = []

    def staged(name: str) -> StagedWeights:
        async def send() -> None:
            sent.append(name)

        group = WeightGroup(name, "127.0.0.1", 1234, [("w", "float32", [2])], [["w"]])
        return StagedWeights([group], send)

    for version, name in enumerate(["g1", "g1", "g2"], 1):
        await engine.update_weights(staged(name), version=version)
    await engine.aclose()
    calls = [(path, body.get("group_name")) for path, body in fake.calls if "weights_update_group" in path]
    assert calls == [
        ("/init_weights_update_group", "g1"),
        ("/destroy_weights_update_group", "g1"),
        ("/init_weights_update_group", "g2"),
        ("/destroy_weights_update_group", "g2"),
    ]
    assert sent == ["g1", "g1", "g2"]
    assert sum(path == "/update_weights_from_distributed" for path, _ in fake.calls) == 3
