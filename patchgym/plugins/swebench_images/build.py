"""Build one SWE-bench instance image with `docker build --network none`, cached by content.

The image is named as the harness names a locally built instance image
(`sweb.eval.{arch}.{instance_id}:{tag}`) and labelled with a key: the sha256 of everything
that went in (the base image's id, the Dockerfile and scripts, the requirement files, the
repository and commit, every wheel's sha256). An image whose label matches is up to date and
is not built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from patchgym.core.errors import BuildError, PatchgymError
from patchgym.plugins.swe_data import swebench_image
from patchgym.plugins.swebench_images.bases import Base, ensure_base
from patchgym.plugins.swebench_images.recipe import VENV, Recipe, make_recipe
from patchgym.plugins.swebench_images.sources import RepoSources, checkout
from patchgym.plugins.swebench_images.wheels import Lock, lock_key, resolve, sha256

RECIPE_VERSION = 1
"""Bump when the image layout below changes: every image key changes with it."""
KEY_LABEL = "patchgym.swebench.key"
WHEELS_DIR = "/opt/patchgym/wheels"
PIP_CONF = f"[global]\nno-index = true\nfind-links = {WHEELS_DIR}\ndisable-pip-version-check = true\n"
"""Every pip in the image installs from the image's wheels: a reinstall works without network."""
ACTIVATE = f"""\
# patchgym build-images: conda is not installed in this image. The SWE-bench environment
# "testbed" is a Python venv at {VENV}; `conda activate testbed` enters it, as in the
# harness's images, and any other conda command fails.
conda() {{
  case "$*" in
    "activate testbed") CONDA_DEFAULT_ENV=testbed; source {VENV}/bin/activate ;;
    deactivate) deactivate; unset CONDA_DEFAULT_ENV ;;
    *) echo "conda is not installed in this image (built by patchgym build-images): conda $*" >&2; return 1 ;;
  esac
}}
"""
DOCKERFILE = """\
FROM {base}
COPY pip.conf /etc/pip.conf
COPY activate /opt/miniconda3/bin/activate
COPY wheels {wheels}
COPY files/ setup_env.sh /root/
RUN /bin/bash /root/setup_env.sh
COPY testbed /testbed
COPY setup_repo.sh /root/
RUN /bin/bash /root/setup_repo.sh
ENV VIRTUAL_ENV={venv} PATH={venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /testbed
"""


@dataclass(frozen=True)
class BuildSettings:
    """Where repositories and wheels are, which bases to use, and how to name images."""

    sources: RepoSources
    cache: Path
    bases: Mapping[str, str] = field(default_factory=dict)
    mirror: str | None = None
    tag: str = "latest"
    arch: str = "x86_64"
    force: bool = False
    offline: bool = False


@dataclass(frozen=True)
class ImageResult:
    """What became of one row: `built`, `cached` (up to date) or `failed` (with `error`)."""

    instance_id: str
    image: str
    status: str
    seconds: float
    error: str = ""
    log: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("instance_id", "image", "status", "seconds", "error", "log")}


def image_key(recipe: Recipe, base: Base, lock: Lock) -> str:
    """The sha256 of everything an image is built from."""
    data = {
        "version": RECIPE_VERSION,
        "base": base.image_id,
        "dockerfile": DOCKERFILE,
        "pip_conf": PIP_CONF,
        "activate": ACTIVATE,
        "repo": recipe.repo,
        "base_commit": recipe.base_commit,
        "env_script": recipe.env_script,
        "repo_script": recipe.repo_script,
        "files": dict(recipe.files),
        "wheels": lock.files,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def write_context(folder: Path, recipe: Recipe, base: Base, lock: Lock, wheels: Path) -> None:
    """The build context: Dockerfile, scripts, the lock's wheels; the checkout is at folder/testbed."""
    (folder / "Dockerfile").write_text(DOCKERFILE.format(base=base.image_id, wheels=WHEELS_DIR, venv=VENV))
    (folder / "pip.conf").write_text(PIP_CONF)
    (folder / "activate").write_text(ACTIVATE)
    (folder / "setup_env.sh").write_text(recipe.script(recipe.env_script))
    (folder / "setup_repo.sh").write_text(recipe.script(recipe.repo_script))
    (folder / "files").mkdir()
    for name, text in recipe.files.items():
        (folder / "files" / name).write_text(text)
    (folder / "wheels").mkdir()
    for name, digest in lock.files.items():
        target = folder / "wheels" / name
        try:
            os.link(wheels / name, target)
        except OSError:
            shutil.copy2(wheels / name, target)
        if sha256(target) != digest:
            raise BuildError(f"{wheels / name} changed since it was locked (sha256 differs): delete it and rebuild")


def docker_build(client: docker.DockerClient, folder: Path, tag: str, labels: dict[str, str], log: Path) -> None:
    """`docker build --network none`; its output goes to `log`; a `BuildError` with its tail on failure."""
    lines: list[str] = []
    error = None
    try:
        for chunk in client.api.build(
            path=str(folder), tag=tag, network_mode="none", rm=True, forcerm=True, labels=labels, decode=True
        ):
            lines.append(chunk.get("stream", ""))
            error = error or chunk.get("error")
    except docker.errors.DockerException as exc:
        error = str(exc)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(lines) + (f"\nERROR: {error}\n" if error else ""))
    if error:
        tail = "".join(lines).strip().splitlines()[-15:]
        raise BuildError(f"docker build failed: {error.strip()}\n" + "\n".join(tail) + f"\n(full log: {log})")


class ImageBuilder:
    """Builds instance images for rows; safe to call from several threads at once."""

    def __init__(self, settings: BuildSettings) -> None:
        self.settings = settings
        self._bases: dict[str, Base] = {}
        self._base_lock = threading.Lock()

    def image_name(self, row: Mapping[str, Any]) -> str:
        return swebench_image(row["instance_id"], namespace="", arch=self.settings.arch, tag=self.settings.tag)

    def _base(self, python: str, client: docker.DockerClient) -> Base:
        with self._base_lock:
            if python not in self._bases:
                self._bases[python] = ensure_base(
                    python, self.settings.bases, mirror=self.settings.mirror, client=client
                )
            return self._bases[python]

    def build(self, row: Mapping[str, Any], stage: Callable[[str], None] = lambda _: None) -> ImageResult:
        """Build (or find up to date) the image of one row; never raises for a row's own fault."""
        start, image = time.monotonic(), self.image_name(row)
        log = self.settings.cache / "logs" / f"{row['instance_id']}.log"

        def result(status: str, error: str = "") -> ImageResult:
            seconds = round(time.monotonic() - start, 1)
            return ImageResult(row["instance_id"], image, status, seconds, error, str(log) if log.exists() else "")

        try:
            client = docker.from_env()
        except docker.errors.DockerException as exc:
            return result("failed", f"no Docker engine is reachable: {exc}")
        try:
            return result(self._build(row, image, log, client, stage))
        except (PatchgymError, OSError, docker.errors.DockerException) as exc:
            return result("failed", str(exc))
        finally:
            client.close()

    def _build(
        self, row: Mapping[str, Any], image: str, log: Path, client: docker.DockerClient, stage: Callable[[str], None]
    ) -> str:
        sources = self.settings.sources
        stage("reading the specs")
        source = sources.require_commit(row["repo"], row["base_commit"])
        recipe = make_recipe(row, sources.reader(row["repo"]))
        stage(f"base for Python {recipe.python}")
        base = self._base(recipe.python, client)
        with tempfile.TemporaryDirectory(prefix="patchgym-image-") as tmp:
            folder, context = Path(tmp), Path(tmp) / "context"
            checkout(source, recipe.repo, recipe.base_commit, context / "testbed")
            stage("resolving wheels")
            key = lock_key(base.target, recipe.repo, recipe.base_commit, recipe.steps)
            # resolving builds the project's metadata, which writes into the tree: use a copy
            project = shutil.copytree(context / "testbed", folder / "project", ignore=shutil.ignore_patterns(".git"))
            settings = self.settings
            lock = resolve(
                recipe.steps, base.target, project=project, cache=settings.cache, key=key, offline=settings.offline
            )
            key = image_key(recipe, base, lock)
            if not self.settings.force and _label(client, image) == key:
                return "cached"
            stage("docker build --network none")
            write_context(context, recipe, base, lock, self.settings.cache / "wheels")
            labels = {KEY_LABEL: key, "patchgym.swebench.instance_id": recipe.instance_id}
            docker_build(client, context, image, labels, log)
        return "built"


def _label(client: docker.DockerClient, image: str) -> str | None:
    try:
        return (client.images.get(image).labels or {}).get(KEY_LABEL)
    except docker.errors.ImageNotFound:
        return None
