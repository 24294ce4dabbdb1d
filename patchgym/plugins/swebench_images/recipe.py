"""What an instance image needs, translated from the `swebench` package's specs for a row.

The harness builds three images: a base (Ubuntu with conda), an environment (`setup_env.sh`:
`conda create -n testbed python=X ...`, then pip installs) and the instance (`setup_repo.sh`:
clone, reset to the base commit, pre-install steps, the install command, a commit). Here the
environment script is translated for a Python venv at the conda environment's path
(`/opt/miniconda3/envs/testbed`), and the harness's own repository script
(`make_repo_script_list_py`) runs as it is, except its `git clone` line: the repository is
copied in from a local source.

- `python`: the harness creates a conda env with that Python; here `pythonX -m venv` runs on a
  Debian base that ships it.
- `packages: requirements.txt`: the repo's requirement files at `environment_setup_commit`, read
  from the local source instead of GitHub, cleaned as the harness cleans them.
- `packages: "a b=1.2"` (conda packages): pip requirements (`b==1.2.*`).
- `packages: environment.yml`: not supported (conda); a clear error.
- `pip_packages`, `pre_install`, `install`: run as the harness runs them, offline, from wheels
  fetched on the host; a pre-install step that needs the network (apt-get, wget) is an error.

`Step`s are the pip resolutions the scripts will ask for, each resolved on the host for the
target Python (see `wheels.py`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from patchgym.core.errors import ConfigError

ENV_NAME = "testbed"
REPO_DIR = "/testbed"
VENV = f"/opt/miniconda3/envs/{ENV_NAME}"
"""Where the harness's conda environment lives; here, a venv."""
REQUIREMENTS_FILE = "/root/requirements.txt"
PROJECT = "{project}"
"""Stands for the repository checkout in a `Step`'s requirement lines."""
NETWORK_COMMANDS = re.compile(r"\b(apt-get|apt|wget|curl|conda)\b")
CONDA_SPEC = re.compile(r"^([A-Za-z0-9_.\-\[\]]+)=([^=<>!~]+)$")
LEGACY_BUILD_REQUIREMENTS = ("setuptools>=40.8.0", "wheel")
"""What pip builds a project without a `[build-system]` table with (PEP 517's fallback)."""

ReadFile = Callable[[str, str], str | None]
"""(commit, path) -> the file's text at that commit, or None if it is absent."""


@dataclass(frozen=True)
class Step:
    """One pip resolution the image's scripts perform: its requirement lines (`{project}` is the
    checkout)."""

    name: str
    requirements: tuple[str, ...]


@dataclass(frozen=True)
class Recipe:
    """Everything an instance image is built from, apart from the wheels and the repository."""

    instance_id: str
    repo: str
    version: str
    base_commit: str
    python: str
    steps: tuple[Step, ...]
    env_script: tuple[str, ...]
    repo_script: tuple[str, ...]
    files: Mapping[str, str] = field(default_factory=dict)
    """Extra files for the build context (name -> text), e.g. requirements.txt."""

    def script(self, lines: tuple[str, ...]) -> str:
        """A script as the harness writes its own (`TestSpec.setup_env_script`)."""
        return "\n".join(["#!/bin/bash", "set -euxo pipefail", *lines]) + "\n"


def _specs(row: Mapping[str, Any]) -> dict[str, Any]:
    from swebench.harness.constants import MAP_REPO_VERSION_TO_SPECS

    specs = MAP_REPO_VERSION_TO_SPECS.get(row["repo"], {}).get(str(row.get("version")))
    if specs is None:
        raise ConfigError(
            f"swebench has no specs for {row['repo']} version {row.get('version')!r}: no image recipe for it"
        )
    return specs


def requirements_text(repo: str, commit: str, read: ReadFile) -> str:
    """The harness's requirements for `repo` at `commit` (`get_requirements_by_commit`), read
    from a local source: the first of the repo's requirement paths that exists, with its `-r`
    files inlined (one level), `-e .`, comment and `.[test` lines dropped, then cleaned."""
    from swebench.harness.constants import MAP_REPO_TO_REQS_PATHS
    from swebench.harness.test_spec.python import clean_requirements

    paths = MAP_REPO_TO_REQS_PATHS.get(repo, [])
    for path in paths:
        text = read(commit, path)
        if text is not None:
            break
    else:
        raise ConfigError(f"{repo} at {commit[:12]} has none of the requirement files {paths}")
    folder = path.rpartition("/")[0]

    def kept(line: str) -> bool:
        return not line.strip().startswith(("-e .", "#", ".[test"))

    original, additional = [], []
    for line in text.split("\n"):
        if line.strip().startswith("-r"):
            name = line[len("-r") :].strip()
            included = read(commit, f"{folder}/{name}" if folder else name)
            additional += [extra for extra in (included or "").split("\n") if kept(extra)]
        elif kept(line):
            original.append(line)
    additional.append("\n".join(original))
    return clean_requirements("\n".join(additional))


def pip_requirements(packages: str) -> list[str]:
    """Conda package specs as pip requirements: `b=1.2` (conda's prefix match) -> `b==1.2.*`."""
    converted = []
    for item in shlex.split(packages):
        match = CONDA_SPEC.match(item)
        converted.append(f"{match[1]}=={match[2]}.*" if match else item)
    return converted


def project_requirement(install: str) -> str:
    """The requirement line an install command stands for (`{project}` for the checkout):
    `python -m pip install [-e] .[extras] [options]`."""
    words = shlex.split(install)
    if words[:4] != ["python", "-m", "pip", "install"]:
        raise ConfigError(f"install command {install!r} is not `python -m pip install ...`: not supported offline")
    editable, target = False, None
    for word in words[4:]:
        if word == "-e":
            editable = True
        elif not word.startswith("-"):
            target = word
    if target is None or not target.startswith("."):
        raise ConfigError(f"install command {install!r} installs no local project")
    return ("-e " if editable else "") + PROJECT + target[1:]


def _env_script(python: str, packages: str, pip_packages: list[str]) -> list[str]:
    """`make_env_script_list_py` for a venv: its steps, in its order."""
    lines = [
        f"python{python} -m venv {VENV}",  # conda create -n testbed python=X
        "source /opt/miniconda3/bin/activate",
        f"conda activate {ENV_NAME}",
        "python -m pip install --upgrade pip setuptools wheel",  # what a new conda env holds
    ]
    if packages == "requirements.txt":
        lines += [f"python -m pip install -r {REQUIREMENTS_FILE}", f"rm {REQUIREMENTS_FILE}"]
    elif packages:
        lines.append("python -m pip install " + " ".join(shlex.quote(p) for p in pip_requirements(packages)))
    if pip_packages:
        lines.append("python -m pip install " + " ".join(shlex.quote(p) for p in pip_packages))
    return lines


def _repo_script(specs: dict[str, Any], repo: str, base_commit: str) -> list[str]:
    """The harness's repository script, its clone line replaced (the checkout is copied in)."""
    from swebench.harness.test_spec.python import make_repo_script_list_py

    lines = make_repo_script_list_py(specs, repo, REPO_DIR, base_commit, ENV_NAME)
    if not lines[0].startswith("git clone "):
        raise ConfigError(f"unexpected first line of swebench's repository script for {repo}: {lines[0]!r}")
    return [f": 'patchgym: {repo} at {base_commit} was copied to {REPO_DIR} from a local source'", *lines[1:]]


def build_requirements(pyproject: str | None) -> tuple[str, ...]:
    """A project's build requirements from its `pyproject.toml` text (PEP 518), or the fallback."""
    import tomllib

    if pyproject is None:
        return LEGACY_BUILD_REQUIREMENTS
    try:
        table = tomllib.loads(pyproject).get("build-system", {})
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"pyproject.toml does not parse: {exc}") from exc
    return tuple(table.get("requires", LEGACY_BUILD_REQUIREMENTS))


def make_recipe(row: Mapping[str, Any], read: ReadFile) -> Recipe:
    """The recipe of a SWE-bench row; `read` gives files of the repository at a commit."""
    from swebench.harness.utils import load_cached_environment_yml

    instance_id, repo, base_commit = row["instance_id"], row["repo"], row["base_commit"]
    specs = _specs(row)
    packages = specs.get("packages", "")
    if packages == "environment.yml" or load_cached_environment_yml(instance_id):
        raise ConfigError(f"{instance_id}: the harness builds its environment with conda (environment.yml)")
    needs_network = [line for line in specs.get("pre_install", []) if NETWORK_COMMANDS.search(line)]
    if needs_network:
        raise ConfigError(f"{instance_id}: a pre_install step needs the network or conda: {needs_network[0]!r}")
    python = str(specs["python"])
    pip_packages = list(specs.get("pip_packages", []))
    env_commit = row.get("environment_setup_commit") or base_commit
    files: dict[str, str] = {}
    steps = [Step("environment", ("pip", "setuptools", "wheel"))]
    if packages == "requirements.txt":
        files["requirements.txt"] = requirements_text(repo, env_commit, read)
        lines = [line.strip() for line in files["requirements.txt"].splitlines()]
        steps.append(Step("requirements", tuple(line for line in lines if line and not line.startswith("#"))))
    elif packages:
        steps.append(Step("packages", tuple(pip_requirements(packages))))
    if pip_packages:
        steps.append(Step("pip_packages", tuple(pip_packages)))
    if specs.get("install"):
        built_with = build_requirements(read(base_commit, "pyproject.toml"))
        steps.append(Step("install", (project_requirement(specs["install"]), *built_with)))
    return Recipe(
        instance_id=instance_id,
        repo=repo,
        version=str(row.get("version")),
        base_commit=base_commit,
        python=python,
        steps=tuple(steps),
        env_script=tuple(_env_script(python, packages, pip_packages)),
        repo_script=tuple(_repo_script(specs, repo, base_commit)),
        files=files,
    )
