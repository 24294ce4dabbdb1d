"""Wheels for an image, fetched on the host and locked, so the image builds with no network.

Each `Step` of a recipe (a pip install the image's scripts will run) is resolved for the
target interpreter and platform with `uv pip compile` (pip evaluates environment markers for
the interpreter it runs on, uv for the target), then its pins are downloaded with
`pip download --no-deps` for the target's tags: wheels where PyPI has a compatible one, the
sdist otherwise (pip builds it inside the image, with the image's own Python). An sdist's
build requirements are resolved and fetched the same way.

The result is a lock, `{cache}/locks/{key}.json` (the pins of every step and the sha256 of
every file), keyed by what went into the resolution. Once a lock and its files are in the
cache, nothing needs the network: copy the cache directory to an air-gapped machine and build
there with `offline=True`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)

from patchgym.core.errors import BuildError, ConfigError
from patchgym.plugins.swebench_images.recipe import LEGACY_BUILD_REQUIREMENTS, PROJECT, Step, build_requirements

LOCK_VERSION = 1
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
MAX_SDIST_ROUNDS = 4
"""Rounds of fetching sdists' build requirements (whose own sdists may need more)."""


@dataclass(frozen=True)
class Target:
    """The interpreter and platform an image's packages are for."""

    python: str
    glibc: tuple[int, int]
    arch: str = "x86_64"

    @property
    def version(self) -> tuple[int, int]:
        major, minor = self.python.split(".")[:2]
        return int(major), int(minor)

    @property
    def abi(self) -> str:
        return "cp{}{}".format(*self.version)

    def platforms(self) -> list[str]:
        """manylinux platform tags the target's glibc runs, newest first."""
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_{self.arch}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{self.arch}" for m, name in legacy.items() if m <= minor]

    def tags(self) -> set[Tag]:
        platforms = self.platforms()
        found = set(cpython_tags(self.version, [self.abi], platforms))
        return found | set(compatible_tags(self.version, self.abi, platforms))

    def as_dict(self) -> dict[str, object]:
        return {"python": self.python, "glibc": list(self.glibc), "arch": self.arch}


@dataclass(frozen=True)
class Lock:
    """Pins per step and the files (name -> sha256) an image installs from."""

    key: str
    pins: dict[str, list[str]]
    files: dict[str, str]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def lock_key(target: Target, repo: str, base_commit: str, steps: Iterable[Step]) -> str:
    """What a resolution depends on, hashed: the target, the project's commit and every step."""
    data = {
        "version": LOCK_VERSION,
        "target": target.as_dict(),
        "repo": repo,
        "base_commit": base_commit,
        "steps": [[step.name, list(step.requirements)] for step in steps],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _run(command: list[str], what: str) -> str:
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise BuildError(f"{what} failed: " + "\n".join(lines[-12:]))
    return done.stdout


def compile_step(step: Step, target: Target, project: Path | None, workdir: Path) -> list[str]:
    """`name==version` pins of `step` for `target` (`uv pip compile`)."""
    from uv import find_uv_bin

    lines = [line.replace(PROJECT, str(project)) if project else line for line in step.requirements]
    source = workdir / f"{step.name}.in"
    source.write_text("\n".join(lines) + "\n")
    command = [find_uv_bin(), "pip", "compile", "--quiet", "--no-header", "--no-annotate"]
    command += [
        "--python-version",
        target.python,
        "--python-platform",
        f"{target.arch}-manylinux_{'_'.join(map(str, target.glibc))}",
    ]
    output = _run([*command, str(source)], f"resolving the {step.name} step for Python {target.python}")
    return sorted({f"{m[1]}=={m[2]}" for line in output.splitlines() if (m := PIN.match(line.split(";")[0].strip()))})


def download(pins: list[str], target: Target, wheels: Path, workdir: Path) -> None:
    """Fetch `pins` (no dependencies) for the target into `wheels`."""
    listing = workdir / "pins.txt"
    listing.write_text("\n".join(pins) + "\n")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(wheels)]
    command += ["--python-version", target.python, "--implementation", "cp", "--abi", target.abi]
    for platform in target.platforms():
        command += ["--platform", platform]
    _run([*command, "-r", str(listing)], f"downloading {len(pins)} packages for Python {target.python}")


def _parse(name: str) -> tuple[str, str, frozenset[Tag] | None] | None:
    """(project, version, wheel tags or None for an sdist) of a distribution file name."""
    try:
        project, version, _, tags = parse_wheel_filename(name)
        return str(project), str(version), tags
    except InvalidWheelFilename:
        pass
    try:
        project, version = parse_sdist_filename(name)
        return str(project), str(version), None
    except InvalidSdistFilename:
        return None


def _is_sdist(path: Path) -> bool:
    parsed = _parse(path.name)
    return parsed is not None and parsed[2] is None


def files_for(pins: Iterable[str], target: Target, wheels: Path) -> list[Path]:
    """The files in `wheels` that install `pins` on the target: compatible wheels, else sdists."""
    index: dict[tuple[str, str], list[tuple[Path, frozenset[Tag] | None]]] = {}
    for path in wheels.iterdir():
        if (parsed := _parse(path.name)) is not None:
            index.setdefault((parsed[0], parsed[1]), []).append((path, parsed[2]))
    tags, chosen, missing = target.tags(), [], []
    for pin in pins:
        name, _, version = pin.partition("==")
        candidates = index.get((canonicalize_name(name), version), [])
        usable = [path for path, wheel_tags in candidates if wheel_tags is None or wheel_tags & tags]
        if not usable:
            missing.append(pin)
        chosen += usable
    if missing:
        raise BuildError(f"no wheel or sdist for Python {target.python} of {', '.join(missing)} in {wheels}")
    return sorted(set(chosen))


def sdist_build_requirements(path: Path) -> tuple[str, ...]:
    """The build requirements an sdist declares in its pyproject.toml (or PEP 517's fallback)."""
    text = None
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/pyproject.toml")]
            text = archive.read(names[0]).decode() if names else None
    else:
        with tarfile.open(path) as archive:
            members = [m for m in archive.getmembers() if m.name.count("/") == 1 and m.name.endswith("/pyproject.toml")]
            stream = archive.extractfile(members[0]) if members else None
            text = stream.read().decode() if stream else None
    try:
        return build_requirements(text)
    except ConfigError:
        return LEGACY_BUILD_REQUIREMENTS


def resolve(
    steps: Iterable[Step], target: Target, *, project: Path | None, cache: Path, key: str, offline: bool
) -> Lock:
    """The lock for `steps` (from the cache, or resolved and downloaded now); its files are in
    `{cache}/wheels` and checked against their recorded sha256."""
    wheels, locks = cache / "wheels", cache / "locks"
    wheels.mkdir(parents=True, exist_ok=True)
    locks.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one resolver writes the cache at a time, across processes
        return _resolve(steps, target, project=project, wheels=wheels, lock_path=locks / f"{key}.json", offline=offline)


def _resolve(
    steps: Iterable[Step], target: Target, *, project: Path | None, wheels: Path, lock_path: Path, offline: bool
) -> Lock:
    key, locks = lock_path.stem, lock_path.parent
    if lock_path.is_file():
        lock = Lock(key=key, **json.loads(lock_path.read_text()))
        if _intact(lock, wheels):
            return lock
        if offline:
            raise ConfigError(f"the wheel cache {wheels} lacks files of lock {lock_path.name}: rebuild it with network")
    elif offline:
        raise ConfigError(f"no lock {lock_path.name} in {locks}: resolve this image once with network (PyPI)")
    pins: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="patchgym-wheels-") as tmp:
        for step in steps:
            pins[step.name] = compile_step(step, target, project, Path(tmp))
            download(pins[step.name], target, wheels, Path(tmp))
        done: set[Path] = set()
        for round_ in range(MAX_SDIST_ROUNDS):
            chosen = files_for([p for step_pins in pins.values() for p in step_pins], target, wheels)
            sdists = [path for path in chosen if _is_sdist(path) and path not in done]
            if not sdists:
                break
            needed = sorted({req for path in sdists for req in sdist_build_requirements(path)})
            done.update(sdists)
            step = Step(f"sdist_build_{round_}", tuple(needed))
            pins[step.name] = compile_step(step, target, None, Path(tmp))
            download(pins[step.name], target, wheels, Path(tmp))
    chosen = files_for([p for step_pins in pins.values() for p in step_pins], target, wheels)
    lock = Lock(key=key, pins=pins, files={path.name: sha256(path) for path in chosen})
    lock_path.write_text(json.dumps({"pins": lock.pins, "files": lock.files}, indent=1, sort_keys=True))
    return lock


def _intact(lock: Lock, wheels: Path) -> bool:
    return all((wheels / name).is_file() and sha256(wheels / name) == digest for name, digest in lock.files.items())
