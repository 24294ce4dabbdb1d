"""Build the offline base image: a Debian root filesystem from debootstrap, imported into Docker.

No registry is needed: debootstrap fetches Debian packages from a Debian mirror (or a local
one) and `docker import` turns the tree into an image with python3, git and patch, which the
built-in task sets run on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import docker
import docker.errors

from patchgym.core.errors import BuildError, ConfigError

BASE_PACKAGES = ("git", "patch", "ca-certificates")
"""Debian packages every base image holds besides its Python."""


def build_base_image(
    tag: str,
    *,
    suite: str = "bookworm",
    mirror: str | None = None,
    python: str = "python3",
    extra_packages: tuple[str, ...] = (),
    client: docker.DockerClient | None = None,
) -> str:
    """Create `tag` from a minimal debootstrap of Debian `suite` with the Debian package `python`
    (the suite sets its version), `BASE_PACKAGES` and `extra_packages`; returns the image id."""
    packages = tuple(dict.fromkeys((python, *BASE_PACKAGES, *extra_packages)))
    if shutil.which("debootstrap") is None:
        raise ConfigError("`debootstrap` is not installed: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise ConfigError("debootstrap needs root: run `patchgym sandbox build-base` as root (or with sudo)")
    client = client or docker.from_env()
    repository, _, version = tag.partition(":")
    with tempfile.TemporaryDirectory(prefix="patchgym-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        command = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(root)]
        done = subprocess.run([*command, *([mirror] if mirror else [])], capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(
                f"debootstrap failed (exit {done.returncode}):\n{done.stderr[-2000:] or done.stdout[-2000:]}"
            )
        archive = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(archive), "."], check=True)
        try:
            client.api.import_image(
                src=str(archive),
                repository=repository,
                tag=version or "latest",
                changes=['CMD ["bash"]', "ENV LANG=C.UTF-8"],
            )
        except docker.errors.DockerException as exc:
            raise BuildError(f"docker import of the base image failed: {exc}") from exc
    return client.images.get(tag).id
