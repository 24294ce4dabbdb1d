"""The `easy` task family: generated one-line bugs whose fix the issue text spells out.

Each task is a tiny module of a few arithmetic functions, one of them wrong (an operator or a
constant). The issue gives a failing call and names the wrong expression and the right one, so
a small model can learn the whole loop (read the issue, edit with one command, submit) within
minutes on a CPU: this is the quickstart's task family. Tasks are generated deterministically
from (seed, split, count) into a cache folder in patchgym's task-folder format, including a
`solution.sh` (a one-line `sed` fix) for oracle traces; `train` and `eval` splits never share
a task.
"""

from __future__ import annotations

import difflib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from patchgym.plugins.folder import FolderTaskSet
from patchgym.plugins.generated import SPLIT_SEEDS, generated_task_set, sed_escape

GENERATOR_VERSION = 1
NAMES = ("scale", "shift", "bump", "grow", "trim", "span", "step", "gain", "lift", "drop", "pad", "tilt")
PARAMS = ("x", "n", "v", "k", "m", "z")
MODULES = ("calc", "ops", "mathx", "util", "numbers")
OPERATORS = ("+", "-", "*")


@dataclass(frozen=True)
class Function:
    name: str
    param: str
    op: str
    constant: int

    @property
    def expression(self) -> str:
        return f"{self.param} {self.op} {self.constant}"

    def source(self) -> str:
        return f"def {self.name}({self.param}):\n    return {self.expression}\n"

    def value(self, argument: int) -> int:
        return {"+": argument + self.constant, "-": argument - self.constant, "*": argument * self.constant}[self.op]


def _broken(rng: random.Random, good: Function) -> Function:
    if rng.random() < 0.5:
        return Function(good.name, good.param, rng.choice([o for o in OPERATORS if o != good.op]), good.constant)
    return Function(good.name, good.param, good.op, rng.choice([c for c in range(2, 10) if c != good.constant]))


def _test_module(module: str, functions: list[Function]) -> str:
    lines = ["import unittest\n", f"from {module} import {', '.join(f.name for f in functions)}\n\n"]
    for f in functions:
        lines.append(f"\nclass Test{f.name.title()}(unittest.TestCase):\n    def test_{f.name}(self):\n")
        lines += [f"        self.assertEqual({f.name}({a}), {f.value(a)})\n" for a in (0, 3, 7)]
    return "".join(lines)


def _write_task(folder: Path, task_id: str, rng: random.Random) -> None:
    module = rng.choice(MODULES)
    names = rng.sample(NAMES, 3)
    params = rng.sample(PARAMS, 3)
    functions = [Function(n, p, rng.choice(OPERATORS), rng.randint(2, 9)) for n, p in zip(names, params, strict=True)]
    target = rng.randrange(len(functions))
    good = functions[target]
    bad = _broken(rng, good)
    while bad.value(3) == good.value(3) or bad.value(7) == good.value(7):
        bad = _broken(rng, good)
    broken = [bad if i == target else f for i, f in enumerate(functions)]
    repo = folder / "repo"
    (repo / "tests").mkdir(parents=True)
    buggy_source = "\n\n".join(f.source() for f in broken)
    fixed_source = "\n\n".join(f.source() for f in functions)
    (repo / f"{module}.py").write_text(buggy_source)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / f"test_{module}.py").write_text(_test_module(module, functions))
    diff = difflib.unified_diff(
        buggy_source.splitlines(keepends=True),
        fixed_source.splitlines(keepends=True),
        f"a/{module}.py",
        f"b/{module}.py",
    )
    (folder / "gold.patch").write_text("".join(diff))
    (folder / "solution.sh").write_text(
        f"sed -i 's/{sed_escape(bad.expression)}/{sed_escape(good.expression)}/' {module}.py\n"
    )
    (folder / "issue.md").write_text(
        f"`{good.name}({3})` returns {bad.value(3)} but should return {good.value(3)}.\n"
        f"In {module}.py, `{bad.expression}` should be `{good.expression}`.\n"
    )
    test_id = f"tests.test_{module}.Test{{}}.test_{{}}"
    spec = {
        "id": task_id,
        "fail_to_pass": [test_id.format(good.name.title(), good.name)],
        "pass_to_pass": [test_id.format(f.name.title(), f.name) for f in functions if f is not good],
    }
    (folder / "task.json").write_text(json.dumps(spec, indent=2))


def generate_easy_tasks(directory: Path, *, count: int, seed: int, split: str) -> None:
    """Write `count` easy tasks of `split` into `directory` (deterministic)."""
    rng = random.Random(seed * 7919 + SPLIT_SEEDS[split])
    for index in range(count):
        task_id = f"easy-{split}-{index:04d}"
        _write_task(directory / task_id, task_id, rng)


def easy_task_set(count: int = 64, seed: int = 0, split: str = "train", cache_dir: str | None = None) -> FolderTaskSet:
    """The easy family, generated once into a cache folder and loaded from there."""

    def generate(directory: Path, count: int, seed: int, split: str) -> None:
        generate_easy_tasks(directory, count=count, seed=seed, split=split)

    return generated_task_set(
        "easy", GENERATOR_VERSION, generate, count=count, seed=seed, split=split, cache_dir=cache_dir
    )
