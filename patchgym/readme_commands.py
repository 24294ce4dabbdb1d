"""The README's shell commands, as CI runs them (`.ci/run` runs `python -m patchgym.readme_commands --run`).

Every line of the README's ```bash blocks is a command (comments and blank lines aside, a trailing
`# ...` dropped). CI runs them in order, in the repository, with the venv's `pip` and `patchgym`
first on PATH, except those in `NOT_RUN`, each with the reason: the GPU build of torch on a CPU
machine, and `.ci/run` itself. tests/test_readme.py checks that the list is what the README holds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)

NOT_RUN = {
    "pip install torch==2.13.0": "the GPU build of torch: CI has no GPU, it installs the CPU line above it",
    "bash .ci/run": "CI itself",
}


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of the README's bash blocks, in order."""
    text = README.read_text() if text is None else text
    commands = []
    for block in _BLOCK.findall(text):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def ci_commands(text: str | None = None) -> list[str]:
    """The commands CI runs: the README's, less `NOT_RUN`."""
    return [command for command in readme_commands(text) if command not in NOT_RUN]


def run(venv_bin: Path) -> int:
    """Run the CI commands in the repository (a run directory the quickstart left is removed first)."""
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    shutil.rmtree(ROOT / "runs" / "quickstart", ignore_errors=True)
    for command in ci_commands():
        print(f"+ {command}", flush=True)
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env)
        if done.returncode:
            print(f"README command failed ({done.returncode}): {command}", file=sys.stderr)
            return done.returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run them (default: list them)")
    args = parser.parse_args(argv)
    if args.run:
        return run(Path(sys.executable).parent)
    for command in readme_commands():
        reason = NOT_RUN.get(command)
        print(f"{command}    # not run in CI: {reason}" if reason else command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
