"""The images under deploy/ fail their build when a required part fails, and check their base's Python.

The images cannot be built here (their CUDA and ROCm bases are not reachable): this reads each
Dockerfile's instructions as Docker does (continuation lines joined) and checks what decides
whether a failure stops the build: the shell every RUN uses, and no step that swallows a failure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "deploy").glob("Dockerfile.*"))
MASKS = re.compile(r"\|\|\s*(true|:|echo|exit 0)\b|;\s*(true|exit 0)\s*$|\bset \+e\b")
"""A command that turns a failure into success."""


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments and parser directives dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def problems(text: str) -> list[str]:
    """What lets a failing step pass in a Dockerfile (empty: every failure fails the build)."""
    steps = instructions(text)
    found = []
    shells = [args for keyword, args in steps if keyword == "SHELL"]
    first_run = next((i for i, (keyword, _) in enumerate(steps) if keyword == "RUN"), len(steps))
    shell_at = next((i for i, (keyword, _) in enumerate(steps) if keyword == "SHELL"), len(steps))
    if not shells or shell_at > first_run or not all("errexit" in s and "pipefail" in s for s in shells):
        found.append("no SHELL with errexit and pipefail before the first RUN")
    for keyword, args in steps:
        if keyword == "RUN" and MASKS.search(args):
            found.append(f"RUN swallows a failure: {args[:120]}")
        fallbacks = [args[m.end() :] for m in re.finditer(r"\|\|", args)] if keyword == "RUN" else []
        if any(not re.match(r"\s*\{.*?exit [1-9]\d*\s*;\s*\}", rest) for rest in fallbacks):
            found.append(f"RUN has an || that does not fail: {args[:120]}")
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_failing_step_fails_the_build(path: Path) -> None:
    assert problems(path.read_text()) == []


def test_the_check_catches_what_let_transformer_engine_fail_silently() -> None:
    """The CUDA image's old TransformerEngine step (`|| echo ...`) and a RUN under sh without pipefail."""
    old = (
        'FROM base\nSHELL ["/bin/bash", "-o", "errexit", "-o", "pipefail", "-c"]\n'
        'RUN pip install "transformer_engine[pytorch]==2.8" || \\\n    echo "not installed"\n'
    )
    assert [p.split(":")[0] for p in problems(old)] == ["RUN swallows a failure", "RUN has an || that does not fail"]
    assert problems("FROM base\nRUN curl x | sh\n") == ["no SHELL with errexit and pipefail before the first RUN"]
    assert problems("FROM b\nSHELL [\"/bin/bash\", \"-o\", \"errexit\", \"-o\", \"pipefail\", \"-c\"]\n"
                    "RUN pip uninstall -y x || true\n")  # fmt: skip
    assert problems('FROM b\nSHELL ["/bin/bash", "-o", "errexit", "-o", "pipefail", "-c"]\n'
                    'RUN test -n "$X" || { echo "set X"; exit 1; }\n') == []  # fmt: skip


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_each_required_part_is_checked_after_its_install(path: Path) -> None:
    """The base's Python first (against pyproject's requires-python), then TransformerEngine, megatron-core,
    SGLang and patchgym, each install followed in the same RUN by a check that fails without it."""
    steps = [args for keyword, args in instructions(path.read_text()) if keyword == "RUN"]
    required = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert required is not None
    assert f"sys.version_info >= ({required[1]}, {required[2]})" in steps[0]  # before anything is installed
    assert all(re.search(r"(^|&& )pip ", step) is None for step in steps)  # the checked interpreter installs
    te = next(step for step in steps if "transformer_engine" in step.lower() or "TransformerEngine" in step)
    assert "pip show transformer_engine" in te
    final = steps[-1]
    assert "import torch, megatron.core, sglang, patchgym" in final
    accelerator = "cuda" if path.name.endswith("cuda") else "hip"
    assert f"assert torch.version.{accelerator}" in final


def test_the_rocm_base_is_required_and_ray_start_settings_live_in_the_image() -> None:
    """The reference stack's ROCm base runs Python 3.10: no default BASE, so no build starts from it unseen;
    RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES is set where `ray start` runs (the image)."""
    steps = instructions((ROOT / "deploy" / "Dockerfile.rocm").read_text())
    assert ("ARG", "BASE") in steps and steps.index(("ARG", "BASE")) < steps.index(("FROM", "${BASE}"))
    assert ("ENV", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1") in steps
