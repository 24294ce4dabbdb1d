"""Base images with the Python a spec asks for, built offline from Debian packages.

The harness's base is Ubuntu with conda, which needs anaconda.org. Here a base is a minimal
Debian (debootstrap, as `patchgym sandbox build-base`) whose suite ships that Python, with its
venv module. A Python no Debian suite ships needs a base image of the user's (`--base X=IMAGE`:
any image with `pythonX`, its `venv` module and git).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import docker
import docker.errors

from patchgym.core.errors import BuildError, ConfigError
from patchgym.plugins.swebench_images.wheels import Target

DEBIAN_PYTHONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "3.9": ("bullseye", ("python3.9-venv", "python3-distutils")),
    "3.11": ("bookworm", ("python3.11-venv", "python3-distutils")),
    "3.13": ("trixie", ("python3.13-venv",)),
}
"""Python version -> (Debian suite that ships it, packages besides pythonX.Y)."""
BASE_TAG = "patchgym/swebench-base:python{python}"


@dataclass(frozen=True)
class Base:
    """A base image (by id, so a rebuilt base changes every image key) and its target platform."""

    image_id: str
    target: Target


def base_tag(python: str) -> str:
    return BASE_TAG.format(python=python)


def build_debian_base(python: str, *, mirror: str | None, client: docker.DockerClient) -> str:
    """Build `base_tag(python)` with debootstrap; a `ConfigError` if no suite ships `python`."""
    from patchgym.backends.sandbox.docker_base import build_base_image

    if python not in DEBIAN_PYTHONS:
        raise ConfigError(
            f"no Debian suite here ships Python {python} (known: {', '.join(DEBIAN_PYTHONS)}): give a base image "
            f"with python{python}, its venv module and git as --base {python}=IMAGE"
        )
    suite, packages = DEBIAN_PYTHONS[python]
    return build_base_image(
        base_tag(python), suite=suite, mirror=mirror, python=f"python{python}", extra_packages=packages, client=client
    )


def probe(image: str, python: str, client: docker.DockerClient) -> Target:
    """The target platform of `image` (its glibc), checking it runs `pythonX -m venv`."""
    code = "import platform, venv; print(platform.libc_ver()[1])"
    try:
        out = client.containers.run(image, ["python" + python, "-c", code], network_mode="none", remove=True)
    except docker.errors.ContainerError as exc:
        raise ConfigError(f"base image {image} cannot run python{python} with its venv module: {exc}") from exc
    except docker.errors.DockerException as exc:
        raise BuildError(f"cannot run base image {image}: {exc}") from exc
    version = out.decode().strip()
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        raise ConfigError(f"base image {image} has no glibc (libc_ver {version!r}): use a glibc-based image") from None
    return Target(python=python, glibc=(major, minor))


def ensure_base(python: str, given: Mapping[str, str], *, mirror: str | None, client: docker.DockerClient) -> Base:
    """The base for `python`: the given image, or `base_tag(python)` (built now if missing)."""
    image = given.get(python) or base_tag(python)
    try:
        found = client.images.get(image)
    except docker.errors.ImageNotFound:
        if python in given:
            raise ConfigError(f"the base image {image} given for Python {python} does not exist") from None
        build_debian_base(python, mirror=mirror, client=client)
        found = client.images.get(image)
    return Base(image_id=found.id, target=probe(found.id, python, client))
