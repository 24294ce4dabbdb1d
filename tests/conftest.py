"""Shared fixtures: sandbox backends under test and a small workspace; and the CI rule on skips.

In CI (`CI=true`) every test runs: a skip there is reported as a failure unless its reason starts
with one of `CI_SKIP_REASONS` (a live cloud key CI does not hold, or a Python version another
step of `.ci/run` covers). That covers skips at collection too, so a module-level
`pytest.importorskip` of a missing optional package fails CI instead of passing quietly.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Generator
from pathlib import Path

import pytest

from patchgym.backends.sandbox.local import LocalSandboxBackend
from patchgym.core.plugins import reset_registry
from patchgym.core.sandbox import Sandbox, SandboxBackend, SandboxSpec

CI_SKIP_REASONS = (
    "live E2B test: set E2B_API_KEY",  # a live cloud account: CI holds no key
    "Harbor needs Python >= 3.12",  # run by .ci/run's Python 3.12 step
    "the refusal is for Python < 3.12",  # run by .ci/run's main (Python 3.11) step
)
"""Prefixes of the only skip reasons allowed in CI."""


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _fail_skip_in_ci(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turn a skip into a failure in CI unless its reason is allowed there (xfail is no skip)."""
    if not (_in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if reason.startswith(CI_SKIP_REASONS):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in CI, where every test must run: {reason}\n"
        "(install what it needs in .ci/run; only a reason in tests/conftest.py CI_SKIP_REASONS may skip in CI)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _fail_skip_in_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_skip_in_ci(report)
    return report


def docker_problem() -> str | None:
    """Why the Docker tests cannot run here, or None if they can."""
    try:
        import docker
        import docker.errors

        from patchgym.backends.sandbox.docker import DEFAULT_IMAGE
    except ImportError:
        return "the docker SDK is not installed (pip install 'patchgym[docker]')"
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # any failure to reach the engine
        return f"no Docker engine is reachable ({exc})"
    try:
        client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        return f"the base image {DEFAULT_IMAGE} is missing: run `patchgym sandbox build-base`"
    finally:
        client.close()
    return None


def require_docker() -> None:
    """Skip outside CI when Docker is unusable; in CI (CI=true) that is a failure."""
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Docker tests must run in CI: {problem}")
    pytest.skip(problem)


def require_fake_e2b() -> str:
    """The base URL of the local E2B stand-in (tests/fake_e2b.py), started once per session."""
    problem = None
    if importlib.util.find_spec("e2b") is None or importlib.util.find_spec("uvicorn") is None:
        problem = "the e2b SDK or uvicorn is not installed (pip install 'patchgym[e2b,dev]')"
    elif shutil.which("bwrap") is None:
        problem = "the E2B stand-in runs commands under bubblewrap, which is not installed"
    if problem is None:
        return _fake_e2b_url()
    if os.environ.get("CI") == "true":
        pytest.fail(f"E2B tests must run in CI: {problem}")
    pytest.skip(problem)


@functools.cache
def _fake_e2b_url() -> str:
    root = Path(__file__).resolve().parent.parent
    server = subprocess.Popen([sys.executable, "-m", "tests.fake_e2b"], cwd=root, stdout=subprocess.PIPE, text=True)
    atexit.register(server.terminate)
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line.startswith("listening on "):
        server.kill()
        pytest.fail(f"the E2B stand-in did not start (it printed {line!r})")
    return f"http://127.0.0.1:{int(line.split()[-1])}"


def make_e2b_backend(**settings: object) -> SandboxBackend:
    from patchgym.backends.sandbox.e2b import E2BSandboxBackend

    url = require_fake_e2b()
    return E2BSandboxBackend(api_key="fake", api_url=url, sandbox_url=url, http_version="1.1", **settings)  # type: ignore[arg-type]


def make_harbor_backend(**settings: object) -> SandboxBackend:
    """The harbor backend over tests/harbor_local_env.py; skipped below Python 3.12 (CI runs it in a 3.12 venv)."""
    if sys.version_info < (3, 12):
        pytest.skip("Harbor needs Python >= 3.12 (CI tests it in a Python 3.12 virtualenv)")
    if importlib.util.find_spec("harbor") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Harbor tests must run in CI: pip install 'patchgym[harbor]'")
        pytest.skip("harbor is not installed (pip install 'patchgym[harbor]')")
    if shutil.which("bwrap") is None:
        pytest.skip("the local Harbor test provider runs commands under bubblewrap, which is not installed")
    from patchgym.backends.sandbox.harbor import HarborSandboxBackend

    return HarborSandboxBackend(import_path="tests.harbor_local_env:LocalEnvironment", **settings)  # type: ignore[arg-type]


BACKENDS = ["local-none", "local-bwrap", "docker", "docker-exec", "e2b", "harbor"]
"""`docker` runs commands over the exec channel, `docker-exec` as one `docker exec` each."""


def make_backend(kind: str, tmp_path: Path) -> SandboxBackend:
    if kind == "e2b":
        return make_e2b_backend()
    if kind == "harbor":
        return make_harbor_backend()
    if kind in ("docker", "docker-exec"):
        require_docker()
        from patchgym.backends.sandbox.docker import DockerSandboxBackend

        return DockerSandboxBackend(concurrency=8, exec_channel=kind == "docker")
    if kind == "local-bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    root = tmp_path / "sandboxes"
    root.mkdir(exist_ok=True)
    return LocalSandboxBackend(root_dir=root, isolation=kind.removeprefix("local-"))  # type: ignore[arg-type]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "hello.txt").write_text("hello\n")
    return root


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SandboxBackend]:
    backend = make_backend(request.param, tmp_path)
    yield backend
    await backend.aclose()


@pytest.fixture
async def sandbox(backend: SandboxBackend, workspace: Path) -> AsyncIterator[Sandbox]:
    box = await backend.create(SandboxSpec(workspace=workspace, labels={"suite": "conformance"}))
    yield box
    await box.close()


@pytest.fixture(autouse=True)
def fresh_registry() -> None:
    reset_registry()


def require_train_extra() -> None:
    """Skip outside CI when torch/transformers are missing; in CI (CI=true) that is a failure."""
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the train extra must be installed in CI: {exc}")
        pytest.skip(f"needs pip install 'patchgym[train]' ({exc})", allow_module_level=True)


@pytest.fixture
def train_extra() -> None:
    """Use with `pytest.mark.usefixtures("train_extra")` on tests that need torch and transformers."""
    require_train_extra()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 model and tokenizer (patchgym.models.tiny), written once per session."""
    require_train_extra()
    from patchgym.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny-model"))
