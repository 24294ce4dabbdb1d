"""Build a separate virtual environment that runs a real SGLang server on CPU.

`pip install sglang` pulls the CUDA stack (several GB) and cannot resolve next to the CPU
build of torch. This installs the pinned release with `--no-deps`, then its requirements
minus the CUDA-only ones, on top of the CPU torch, and writes two stub modules for what the
CPU path imports at module level but never calls (`torchvision`, `sgl_kernel`). The stubs
live in their own folder, put on PYTHONPATH only when a server is launched on CPU.

The venv is cached under a key of the pinned versions, the Python version and this recipe (the
excluded requirements, the stubs and the source of the build steps): it is rebuilt only when
the key changes, or when forced with `--fresh`. Concurrent builders of one key take turns on a
lock file, so the second one reuses the first one's venv.

Run it as `python -m patchgym.backends.inference.sglang_venv [--fresh] [PATH]`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import inspect
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from patchgym.core.errors import BuildError

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
STUBS_DIR = "patchgym-stubs"
READY_MARKER = ".patchgym-ready"

EXCLUDED_PREFIXES = (
    "cuda-",
    "flash",
    "humming",
    "nvidia-cutlass",
    "nvidia-mathdx",
    "nvshmem",
    "quack",
    "sgl-",
    "sglang-kernel",
    "tilelang",
    "torch",
    "timm",
    "tml-renderers",
    "deepseek-recipe",
)
"""Requirements of sglang that are CUDA-only (or torch itself, installed first as the CPU build)."""

STUBBED_PACKAGES = ("torchvision", "sgl_kernel")
"""Imported at module level by sglang's (and transformers') text path on CPU, never called for a dense model."""

STUB_SOURCE = '''"""Stub of {name} for patchgym's CPU SGLang venv: imports succeed, any use raises."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+patchgym.stub"


class _Placeholder(type):
    """Stands for any name; attributes are names too (enum members), calls raise."""

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return f"{{cls.__name__}}.{{attr}}"

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"{{cls.__module__}}.{{cls.__name__}} is a stub in patchgym's CPU SGLang venv")


def _placeholder(module, attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    value = _Placeholder(attr, (), {{"__module__": module.__name__}})
    setattr(module, attr, value)
    return value


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        return _placeholder(self, attr)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("{name}."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.append(_StubFinder())


def __getattr__(attr):
    return _placeholder(sys.modules[__name__], attr)
'''


def recipe_key() -> str:
    """A hash of what the venv is built from: pinned versions, Python version, exclusions, stubs, build steps."""
    recipe = f"{SGLANG_VERSION}|{TORCH_VERSION}|{EXCLUDED_PREFIXES}|{STUB_SOURCE}|{sys.version_info[:2]}|{BUILD_STEPS}"
    return hashlib.sha256(recipe.encode()).hexdigest()[:10]


def default_venv_path() -> Path:
    """`~/.cache/patchgym/sglang-<version>-venv-<recipe key>`."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "patchgym" / f"sglang-{SGLANG_VERSION}-venv-{recipe_key()}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stubs_path(venv: Path) -> Path:
    return venv / STUBS_DIR


def is_ready(venv: Path) -> bool:
    """Built to the end by this recipe (the marker holds the recipe key)."""
    marker = venv / READY_MARKER
    return marker.is_file() and marker.read_text().startswith(recipe_key()) and venv_python(venv).exists()


def cpu_requirements(metadata_dir: Path) -> list[str]:
    """sglang's requirements for this platform, without extras and without the CUDA-only ones."""
    from packaging.requirements import Requirement

    dist = importlib.metadata.PathDistribution(metadata_dir)
    kept = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name.startswith(EXCLUDED_PREFIXES):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def write_stubs(directory: Path) -> None:
    """One package per stubbed name; submodules of it are made up on import."""
    for name in STUBBED_PACKAGES:
        (directory / name).mkdir(parents=True, exist_ok=True)
        (directory / name / "__init__.py").write_text(STUB_SOURCE.format(name=name))


def _pip(python: Path, *args: str, log: Path) -> None:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"building the SGLang venv failed: {' '.join(args[:3])}... (log {log}):\n{tail}")


def build_sglang_venv(
    venv: Path | None = None, *, fresh: bool = False, progress: Callable[[str], object] = print
) -> Path:
    """Create (or reuse, unless `fresh`) the CPU SGLang venv at `venv`; returns its path."""
    venv = Path(venv) if venv is not None else default_venv_path()
    if is_ready(venv) and not fresh:
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse its venv
        if fresh or not is_ready(venv):
            _build(venv, progress)
    return venv


def _build(venv: Path, progress: Callable[[str], object]) -> None:
    """Build the venv at `venv` from scratch; the ready marker, written last, records the recipe key."""
    if venv.exists():
        shutil.rmtree(venv)
    log = venv.parent / f"{venv.name}.log"
    log.write_text("")
    started = time.monotonic()
    python = venv_python(venv)
    progress(f"creating {venv} (log {log})")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    progress(f"installing torch=={TORCH_VERSION} (CPU build)")
    _pip(python, f"torch=={TORCH_VERSION}", log=log)
    progress(f"installing sglang=={SGLANG_VERSION} --no-deps")
    _pip(python, "--no-deps", f"sglang=={SGLANG_VERSION}", log=log)
    metadata = next((venv / "lib").glob(f"python*/site-packages/sglang-{SGLANG_VERSION}.dist-info"), None)
    if metadata is None:
        raise BuildError(f"sglang {SGLANG_VERSION} installed no metadata under {venv}; see {log}")
    requirements = cpu_requirements(metadata)
    progress(f"installing {len(requirements)} non-CUDA requirements of sglang")
    constraints = venv / "torch-constraint.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}\n")
    _pip(python, "-c", str(constraints), *requirements, log=log)
    stubs = stubs_path(venv)
    write_stubs(stubs)
    check = subprocess.run(
        [str(python), "-c", "import sglang, torch; print(sglang.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(stubs)},
    )
    if check.returncode != 0:
        raise BuildError(f"the SGLang venv at {venv} cannot import sglang:\n{check.stderr[-2000:]}")
    (venv / READY_MARKER).write_text(f"{recipe_key()} {check.stdout}")
    progress(f"SGLang venv ready in {time.monotonic() - started:.0f} s: {check.stdout.strip()}")


BUILD_STEPS = "".join(inspect.getsource(f) for f in (_build, cpu_requirements, write_stubs, _pip))
"""The source of the build steps, part of the recipe key: changing how the venv is built makes a new one."""


if __name__ == "__main__":
    args = sys.argv[1:]
    fresh = "--fresh" in args
    paths = [a for a in args if a != "--fresh"]
    print(build_sglang_venv(Path(paths[0]) if paths else None, fresh=fresh))
