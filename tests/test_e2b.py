"""E2B-specific behaviour: error mapping, leases, creation limits and backoff, reaping, tasks end to end.

The shared sandbox contract runs on E2B (through the local stand-in tests/fake_e2b.py) in
test_sandbox_conformance.py. A live test runs only when E2B_API_KEY is set.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from patchgym.core.errors import (
    BuildError,
    CapacityError,
    ConfigError,
    SandboxLostError,
    SandboxStartError,
    TransportError,
)
from patchgym.core.sandbox import SandboxSpec
from tests.conftest import make_e2b_backend, require_fake_e2b

e2b = pytest.importorskip("e2b")
from e2b import exceptions as sdk  # noqa: E402

from patchgym.backends.sandbox.e2b import E2BSandboxBackend, template_name, translate_e2b_error  # noqa: E402


@pytest.fixture
async def backend() -> AsyncIterator[E2BSandboxBackend]:
    backend = make_e2b_backend(backoff_base_s=0.01)
    assert isinstance(backend, E2BSandboxBackend)
    yield backend
    await backend.reap({"patchgym.run": backend.run_id})


async def inject(faults: dict[str, list[dict[str, Any]]]) -> None:
    """Queue faults in the stand-in: route -> answers it gives before behaving normally."""
    async with httpx.AsyncClient(base_url=require_fake_e2b(), headers={"X-API-KEY": "fake"}) as client:
        (await client.post("/_fake/faults", json=faults)).raise_for_status()


async def calls(route: str) -> int:
    async with httpx.AsyncClient(base_url=require_fake_e2b(), headers={"X-API-KEY": "fake"}) as client:
        return (await client.get("/_fake/calls")).json().get(route, 0)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (sdk.RateLimitException("429: Rate limit exceeded"), CapacityError),
        (sdk.ServiceBusyException("503: Service temporarily unavailable"), CapacityError),
        (sdk.SandboxNotFoundException("sandbox x not found"), SandboxLostError),
        (sdk.SandboxNotRunningException("was not found"), SandboxLostError),
        (sdk.SandboxUnreachableException("port is not open"), TransportError),
        (sdk.TimeoutException("Request timed out"), TransportError),
        (sdk.AuthenticationException("401: Unauthorized"), ConfigError),
        (sdk.BuildException("build failed"), BuildError),
        (sdk.TemplateException("old envd"), BuildError),
        (sdk.FileNotFoundException("no such file"), FileNotFoundError),
        (Exception("Command ended without an end event"), TransportError),
        (httpx.ReadError("connection reset"), TransportError),
    ],
)
def test_sdk_errors_map_onto_patchgym_errors(exc: Exception, expected: type[Exception]) -> None:
    mapped = translate_e2b_error(exc, "op")
    assert type(mapped) is expected
    assert str(mapped).startswith("op: ")


async def test_rate_limited_create_backs_off_and_succeeds(workspace: Path) -> None:
    backend = make_e2b_backend(sdk_retries=0, create_attempts=3, backoff_base_s=0.01)
    before = await calls("create")
    await inject({"create": [{"status": 429, "message": "maximum number of concurrent sandboxes"}] * 2})
    async with await backend.create(SandboxSpec(workspace=workspace)) as box:
        assert (await box.exec("cat pkg/hello.txt", timeout_s=30)).stdout == "hello\n"
    assert await calls("create") - before == 3


async def test_sdk_honours_retry_after_before_our_backoff(workspace: Path) -> None:
    backend = make_e2b_backend(sdk_retries=2, backoff_base_s=100.0)
    await inject({"create": [{"status": 429, "message": "slow down", "headers": {"Retry-After": "1"}}]})
    started = asyncio.get_running_loop().time()
    async with await backend.create(SandboxSpec(workspace=workspace)):
        elapsed = asyncio.get_running_loop().time() - started
    assert 1.0 <= elapsed < 10.0, "the SDK should wait Retry-After once; our 100 s backoff must not run"


async def test_capacity_error_after_the_last_attempt(workspace: Path) -> None:
    backend = make_e2b_backend(sdk_retries=0, create_attempts=2, backoff_base_s=0.01)
    await inject({"create": [{"status": 503, "message": "no capacity"}] * 2})
    with pytest.raises(CapacityError, match="out of capacity") as caught:
        await backend.create(SandboxSpec(workspace=workspace))
    assert caught.value.retryable and caught.value.kind == "capacity"


async def test_bad_credentials_are_a_config_error(workspace: Path) -> None:
    backend = make_e2b_backend()
    await inject({"create": [{"status": 401, "message": "invalid API key"}]})
    with pytest.raises(ConfigError, match="E2B_API_KEY"):
        await backend.create(SandboxSpec(workspace=workspace))


def test_backoff_is_exponential_capped_and_jittered() -> None:
    backend = E2BSandboxBackend(api_key="x", backoff_base_s=1.0, backoff_max_s=8.0)
    error = CapacityError("busy")
    for attempt, base in [(0, 1.0), (1, 2.0), (2, 4.0), (5, 8.0)]:
        delays = {backend.backoff_s(attempt, error) for _ in range(50)}
        assert all(0.5 * base <= d < 1.5 * base for d in delays) and len(delays) > 1
    assert backend.backoff_s(3, CapacityError("busy", retry_after_s=7.0)) == 7.0


async def test_concurrent_creates_are_limited(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_e2b_backend(create_concurrency=2)
    original = e2b.AsyncSandbox.create.__func__
    in_flight, peak = 0, 0

    async def counting_create(cls: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.1)
            return await original(cls, *args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(e2b.AsyncSandbox, "create", classmethod(counting_create))
    boxes = await asyncio.gather(*(backend.create(SandboxSpec(workspace=workspace)) for _ in range(6)))
    assert peak == 2
    for box in boxes:
        await box.close()


async def gone(box: Any, deadline_s: float = 60.0) -> bool:
    """Whether `box` is lost within a deadline generous for a loaded machine (polled, not slept on)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while loop.time() < give_up:
        try:
            await box.exec("true", timeout_s=30)
        except SandboxLostError:
            return True
        await asyncio.sleep(0.2)
    return False


async def test_lease_is_renewed_while_open_and_expires_without_renewal(workspace: Path) -> None:
    # The renewing sandbox is created first: once the other one's lease of 4 s ended, so did the
    # first lease of this one, and only renewals (every 0.25 s, 3.75 s of slack) kept it.
    renewing = make_e2b_backend(lease_s=4, lease_renew_s=0.25)
    abandoned = make_e2b_backend(lease_s=4, lease_renew_s=0)
    renewals = await calls("timeout")
    kept = await renewing.create(SandboxSpec(workspace=workspace))
    lost = await abandoned.create(SandboxSpec(workspace=workspace))
    assert await gone(lost), "a sandbox whose lease was not renewed did not expire"
    assert (await kept.exec("echo alive", timeout_s=30)).stdout == "alive\n"
    assert await calls("timeout") > renewals
    with pytest.raises(SandboxLostError, match="gone"):
        await lost.exec("echo alive", timeout_s=30)
    await kept.close()
    await lost.close()  # quiet although the sandbox is gone


async def test_sandbox_killed_underneath_is_sandbox_lost(backend: E2BSandboxBackend, workspace: Path) -> None:
    box = await backend.create(SandboxSpec(workspace=workspace, labels={"victim": "yes"}))
    assert await backend.reap({"victim": "yes"}) == 1
    with pytest.raises(SandboxLostError):
        await box.exec("true", timeout_s=30)
    with pytest.raises(SandboxLostError):
        await box.read_file("pkg/hello.txt")
    await box.close()


async def test_dropped_command_stream_is_a_transport_error(backend: E2BSandboxBackend, workspace: Path) -> None:
    async with await backend.create(SandboxSpec(workspace=workspace)) as box:
        await inject({"start-drop": [{}]})
        with pytest.raises(TransportError, match="stream dropped"):
            await box.exec("sleep 5", timeout_s=30)
        assert (await box.exec("echo next", timeout_s=30)).stdout == "next\n"


async def test_spec_metadata_and_template_reach_e2b(backend: E2BSandboxBackend, workspace: Path) -> None:
    spec = SandboxSpec(workspace=workspace, image="my-template", labels={"task": "t1"})
    async with await backend.create(spec) as box:
        paginator = e2b.AsyncSandbox.list(
            query=e2b.SandboxQuery(metadata={"task": "t1"}), api_key="fake", api_url=require_fake_e2b()
        )
        [info] = await paginator.next_items()
        assert info.sandbox_id == box.sandbox_id and info.template_id == "my-template"
        assert info.metadata == {"patchgym": "1", "patchgym.run": backend.run_id, "task": "t1"}


async def test_dockerfile_template_is_built_once_and_cached_by_content_hash(
    backend: E2BSandboxBackend, tmp_path: Path, workspace: Path
) -> None:
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM python:3.12\nRUN echo {tmp_path.name}\n")
    spec = SandboxSpec(workspace=workspace, dockerfile=context / "Dockerfile")
    name = template_name(context / "Dockerfile", None, None)
    before = await calls("template-build")
    boxes = await asyncio.gather(*(backend.create(spec) for _ in range(3)))
    assert await calls("template-build") - before == 1
    again = make_e2b_backend()  # a fresh process: E2B already has the template
    boxes.append(await again.create(spec))
    assert await calls("template-build") - before == 1
    (context / "extra.txt").write_text("context changed")
    assert template_name(context / "Dockerfile", None, None) != name
    boxes.append(await again.create(SandboxSpec(workspace=workspace, dockerfile=context / "Dockerfile")))
    assert await calls("template-build") - before == 2
    for box in boxes:
        await box.close()


async def test_failed_template_build_is_a_build_error(backend: E2BSandboxBackend, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text(f"FROM python:3.12\nRUN echo {tmp_path.name}-broken\n")
    await inject({"build-error": [{}]})
    with pytest.raises(BuildError, match="injected build error") as caught:
        await backend.create(SandboxSpec(dockerfile=tmp_path / "Dockerfile"))
    assert caught.value.kind == "build" and not caught.value.retryable


async def test_missing_workspace_or_dockerfile_fails_clearly(backend: E2BSandboxBackend, tmp_path: Path) -> None:
    with pytest.raises(SandboxStartError, match="does not exist"):
        await backend.create(SandboxSpec(workspace=tmp_path / "missing"))
    with pytest.raises(BuildError, match="does not exist"):
        await backend.create(SandboxSpec(dockerfile=tmp_path / "missing" / "Dockerfile"))


def test_settings_report_every_limit_and_hide_the_key() -> None:
    settings = E2BSandboxBackend(api_key="secret-key", create_concurrency=3).settings()
    assert "secret-key" not in str(settings)
    assert settings["create_concurrency"] == 3
    assert {"lease_s", "lease_renew_s", "create_attempts", "backoff_base_s", "backoff_max_s"} <= set(settings)


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="create_concurrency"):
        E2BSandboxBackend(create_concurrency=0)
    with pytest.raises(ConfigError, match="lease_s"):
        E2BSandboxBackend(lease_s=0)


def test_registered_as_sandbox_backend_e2b() -> None:
    from patchgym.core.plugins import registry

    backend = registry().create("sandbox", "e2b", api_key="x", create_concurrency=5)
    assert isinstance(backend, E2BSandboxBackend) and backend.settings()["create_concurrency"] == 5


async def test_tiny_task_set_validates_on_e2b(backend: E2BSandboxBackend) -> None:
    from patchgym.core.plugins import registry
    from patchgym.core.validation import validate_task

    tasks = list(registry().create("task_set", "tiny"))
    reports = await asyncio.gather(*(validate_task(backend, task) for task in tasks))
    assert [r.problems for r in reports] == [[] for _ in tasks]


async def test_oracle_episode_on_e2b() -> None:
    from patchgym.core.validation import apply_patch_command
    from patchgym.envs.swe import AsyncSWEEnv

    url = require_fake_e2b()
    options = {"api_key": "fake", "api_url": url, "sandbox_url": url, "http_version": "1.1"}
    env = AsyncSWEEnv("tiny", "e2b", sandbox_options=options)
    try:
        await env.reset(options={"task": "semver-prerelease"})
        assert env.sandbox is not None and env.task is not None and env.task.gold_patch
        await env.step(f"```bash\n{apply_patch_command(env.task.gold_patch)}\n```")
        _, reward, terminated, _, info = await env.step("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        assert (reward, terminated) == (1.0, True) and info["grade"]["resolved"]
    finally:
        await env.close()


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="live E2B test: set E2B_API_KEY to run it")
async def test_live_e2b_round_trip(workspace: Path) -> None:
    backend = E2BSandboxBackend(lease_s=120)
    async with await backend.create(SandboxSpec(workspace=workspace, labels={"suite": "live"})) as box:
        result = await box.exec("cat pkg/hello.txt; exit 3", timeout_s=60)
        assert (result.exit_code, result.stdout) == (3, "hello\n")
        timed = await box.exec("sleep 30", timeout_s=1)
        assert timed.timed_out and timed.exit_code is None
    await backend.reap({"patchgym.run": backend.run_id})
