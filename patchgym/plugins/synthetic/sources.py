"""Code bases to inject bugs into, turned into self-contained workspace snapshots.

A source is one of:
- `stdlib:NAME`: a pure-Python module of the running interpreter's standard library with its
  `Lib/test/test_NAME.py`. The module is copied to `pylib/NAME.py`, the test's imports are
  pointed at the copy, and `test/support` is vendored, so the snapshot runs offline on any
  Python 3 of the same minor version (including a container's).
- a directory: a pure-Python project with a `tests/` (or `test/`) directory of unittest tests.
- an sdist (`.tar.gz`): unpacked, then treated as a directory.

Every `.py` file outside the test, docs, examples, benchmarks and scripts directories is a
candidate for bugs.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from patchgym.core.errors import ConfigError

STDLIB_PACKAGE = "pylib"
IGNORED_NAMES = {".git", "__pycache__", ".venv", "venv", ".tox", "build", "dist", ".mypy_cache", ".pytest_cache"}
NOT_SOURCE = {"setup.py", "conftest.py", "noxfile.py", "tasks.py"}
TEST_DIR_NAMES = ("tests", "test")
NOT_SOURCE_DIRS = {*TEST_DIR_NAMES, "docs", "doc", "examples", "benchmarks", "scripts"}


def unittest_command(start: str, top: str = ".") -> str:
    """The bundled unittest runner discovering tests under `start` (see core/grading.py)."""
    return f"python3 -s -E {{runner}} --report {{report}} --start {start} --top {top}"


@dataclass(frozen=True)
class Snapshot:
    """A clean workspace: where it is, what may be mutated, and how its tests run."""

    repo_id: str
    path: Path
    source_files: tuple[str, ...]
    test_paths: tuple[str, ...]
    test_command: str
    content_sha: str = field(default="")

    @property
    def repo(self) -> str:
        """SWE-smith style repository name: `<repo_id>.<sha8>`."""
        return f"{self.repo_id}.{self.content_sha[:8]}"


def content_sha(root: Path) -> str:
    """A SHA-1 over every file's relative path and bytes (stands in for a commit hash)."""
    digest = hashlib.sha1()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in IGNORED_NAMES or n.endswith((".pyc", ".egg-info"))}


def build_snapshot(source: str, destination_root: Path) -> Snapshot:
    """Materialise `source` under `destination_root/<repo>` and describe it.

    Bad input (unknown module, no tests, not a project) is a `ConfigError` saying what to pass.
    """
    if source.startswith("stdlib:"):
        staging, snapshot = _stdlib(source.removeprefix("stdlib:"))
    elif source.endswith((".tar.gz", ".tgz")) and Path(source).is_file():
        staging, snapshot = _sdist(Path(source))
    elif Path(source).is_dir():
        staging, snapshot = _directory(Path(source))
    else:
        raise ConfigError(
            f"cannot use {source!r} as a bug source: give stdlib:MODULE, a project directory with tests, "
            "or an sdist .tar.gz"
        )
    try:
        sha = content_sha(staging)
        final = destination_root / f"{snapshot.repo_id}.{sha[:8]}"
        if not final.exists():
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(staging, final)
        return Snapshot(snapshot.repo_id, final, snapshot.source_files, snapshot.test_paths, snapshot.test_command, sha)
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)


def _staging() -> Path:
    return Path(tempfile.mkdtemp(prefix="patchgym-synth-")) / "work"


def _stdlib(name: str) -> tuple[Path, Snapshot]:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(f"stdlib:{name}: give the name of a top-level standard-library module, e.g. stdlib:textwrap")
    lib = Path(sysconfig.get_paths()["stdlib"])
    module, test = lib / f"{name}.py", lib / "test" / f"test_{name}.py"
    if not module.is_file():
        raise ConfigError(f"stdlib:{name}: {module} does not exist (only single-file pure-Python modules work)")
    if not test.is_file() or not (lib / "test" / "support").is_dir():
        raise ConfigError(
            f"stdlib:{name}: this Python has no {test} or test/support (on Debian: apt-get install "
            "libpython3-testsuite), or the module's tests are a package"
        )
    staging = _staging()
    (staging / STDLIB_PACKAGE).mkdir(parents=True)
    (staging / STDLIB_PACKAGE / "__init__.py").write_text("")
    shutil.copy2(module, staging / STDLIB_PACKAGE / module.name)
    (staging / "tests").mkdir()
    (staging / "tests" / "__init__.py").write_text("")
    (staging / "tests" / test.name).write_text(redirect_imports(test.read_text(), name))
    (staging / "test").mkdir()
    (staging / "test" / "__init__.py").write_text("")
    shutil.copytree(lib / "test" / "support", staging / "test" / "support", ignore=_ignore)
    return staging, Snapshot(
        repo_id=f"stdlib__{name}",
        path=staging,
        source_files=(f"{STDLIB_PACKAGE}/{module.name}",),
        test_paths=("tests", "test"),
        test_command=unittest_command("tests"),
    )


def redirect_imports(test_source: str, module: str) -> str:
    """Point `import M` / `from M import ...` at `pylib.M`; refuse tests that import M another way."""
    plain = re.compile(rf"^(\s*)import {module}[ \t]*$", re.M)
    star = re.compile(rf"^(\s*)from {module} import ", re.M)
    redirected = plain.sub(rf"\1from {STDLIB_PACKAGE} import {module}", test_source)
    redirected = star.sub(rf"\1from {STDLIB_PACKAGE}.{module} import ", redirected)
    if redirected == test_source or re.search(rf"import_fresh_module\(\s*['\"]{module}['\"]", redirected):
        raise ConfigError(
            f"stdlib:{module}: its test does not import the module with a plain `import {module}` or "
            f"`from {module} import ...` (or uses import_fresh_module), so a copy cannot be put under test"
        )
    return redirected


def _sdist(archive: Path) -> tuple[Path, Snapshot]:
    unpacked = Path(tempfile.mkdtemp(prefix="patchgym-sdist-"))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        roots = [p for p in unpacked.iterdir() if p.is_dir()]
        project = roots[0] if len(roots) == 1 else unpacked
        return _directory(project, repo_name=archive.name.removesuffix(".tar.gz").removesuffix(".tgz"))
    except (tarfile.TarError, OSError) as exc:
        raise ConfigError(f"cannot unpack sdist {archive}: {exc}") from exc
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def _directory(project: Path, repo_name: str | None = None) -> tuple[Path, Snapshot]:
    tests = next((project / n for n in TEST_DIR_NAMES if (project / n).is_dir()), None)
    if tests is None:
        raise ConfigError(f"{project} has no tests/ or test/ directory: the generator needs the project's own tests")
    staging = _staging()
    shutil.copytree(project, staging, ignore=_ignore, symlinks=False)
    sources = tuple(
        str(p.relative_to(staging))
        for p in sorted(staging.rglob("*.py"))
        if p.relative_to(staging).parts[0] not in NOT_SOURCE_DIRS
        and not p.relative_to(staging).parts[0].startswith(".")
        and p.name not in NOT_SOURCE
        and not p.name.startswith("test_")
    )
    if not sources:
        raise ConfigError(f"{project} has no Python source files outside its tests")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", repo_name or project.resolve().name)
    return staging, Snapshot(
        repo_id=f"local__{name}",
        path=staging,
        source_files=sources,
        test_paths=(tests.name,),
        test_command=unittest_command(tests.name),
    )
