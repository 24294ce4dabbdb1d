"""The README's commands are the ones CI runs (`.ci/run` → `python -m patchgym.readme_commands --run`),
and the install lines agree between the README, the quickstart page and CI."""

from __future__ import annotations

import shlex
from pathlib import Path

from patchgym import readme_commands
from patchgym.pipeline.checks import check_light_parts
from patchgym.pipeline.config import load_run_config

ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
GPU_TORCH = "pip install torch==2.13.0"


def test_bash_blocks_are_split_into_commands() -> None:
    text = "x\n```bash\n# a comment\npip install a   # why\n\npatchgym run c.yaml\n```\n```python\nnot = 1\n```\n"
    assert readme_commands.readme_commands(text) == ["pip install a", "patchgym run c.yaml"]


def test_ci_runs_every_readme_command_but_the_gpu_line_and_itself() -> None:
    commands = readme_commands.readme_commands()
    assert set(readme_commands.NOT_RUN) <= set(commands)  # no stale exception
    ci = readme_commands.ci_commands()
    assert ci == [c for c in commands if c not in (GPU_TORCH, "bash .ci/run")]
    assert CPU_TORCH in ci and "patchgym run configs/quickstart.yaml" in ci
    script = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/python -m patchgym.readme_commands --run" in script
    assert CPU_TORCH.replace("pip install", ".venv/bin/python -m pip install -q") in script


def test_install_lines_agree_between_readme_and_quickstart() -> None:
    readme = readme_commands.readme_commands()
    quickstart = readme_commands.readme_commands((ROOT / "docs" / "quickstart.md").read_text())
    for line in (CPU_TORCH, GPU_TORCH, "pip install -e '.[train,report]'"):
        assert line in readme and line in quickstart, line
    assert readme.index(CPU_TORCH) < readme.index(GPU_TORCH)  # the CPU line first, the GPU one beside it


def test_readme_runs_name_configs_that_load_and_reports_of_their_run_dirs() -> None:
    run_dirs = []
    for command in readme_commands.readme_commands():
        words = shlex.split(command)
        if words[:2] == ["patchgym", "run"]:
            config = load_run_config(ROOT / words[2])
            check_light_parts(config)
            run_dirs.append(config.run_dir)
        elif words[:2] == ["patchgym", "report"]:
            assert words[2] in run_dirs, f"{command}: no README run writes {words[2]}"
    assert run_dirs == ["runs/quickstart"]
