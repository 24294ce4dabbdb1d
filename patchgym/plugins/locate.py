"""The `locate` task family: one-line bugs whose place only a command's output reveals.

Each task is a small package of a few modules, each a few one-line arithmetic functions
(`def scale(x): return x * 5`). One function uses a wrong constant. The issue names the
function, the wrong constant and the right one, but not the module or the line: the agent has
to look (`grep -n scale *.py` prints `ops.py:7:def scale(x): return x * 5`) and then edit that
line of that file (`sed -i '7s/5/4/' ops.py`). Module names, function names, the number of
functions and the blank and comment lines between them vary per task, so line numbers do; the
wrong constant also appears in another function, so replacing it everywhere breaks a passing
test. The oracle is those two commands, one per turn (`task.json`'s `oracle_turns`); the
second uses what the first prints, which tests/test_locate.py checks by running it with the
line of another task (reward 0).

This is the rung after `easy` (whose issue spells the fix out and one command solves it); the
`mix` task set interleaves families, e.g. easy and locate, for a ladder between them. Tasks are
generated deterministically from (seed, split, count); `train` and `eval` never share a task.
"""

from __future__ import annotations

import difflib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from patchgym.plugins.easy import OPERATORS, PARAMS, Function
from patchgym.plugins.folder import FolderTaskSet
from patchgym.plugins.generated import SPLIT_SEEDS, generated_task_set

GENERATOR_VERSION = 2
NAMES = (
    "scale", "shift", "bump", "grow", "trim", "span", "gain", "lift", "drop", "pad", "tilt", "nudge",
    "boost", "clamp", "fold", "warp", "skew", "twist", "stretch", "sink", "rise", "push", "pull", "bend",
)  # fmt: skip
MODULES = ("calc", "ops", "mathx", "util", "numbers", "tools", "basic", "extra")
HEADERS = ("# arithmetic helpers", "# small integer functions", "# tested in tests/")
MODULES_PER_TASK = 3
FUNCTIONS_PER_MODULE = (3, 5)


@dataclass(frozen=True)
class Bug:
    """Where the wrong constant is: what the oracle's second command needs from the first's output."""

    module: str
    line: int
    name: str
    bad: int
    good: int

    def commands(self) -> list[str]:
        """The oracle, one command per turn: find the function, then fix its line."""
        return [f"grep -n {self.name} *.py", f"sed -i '{self.line}s/{self.bad}/{self.good}/' {self.module}.py"]


def _module_lines(rng: random.Random, functions: list[Function]) -> list[str | Function]:
    """A module's lines: a few header comments, then the functions with blank lines between some."""
    lines: list[str | Function] = list(rng.sample(HEADERS, rng.randint(0, len(HEADERS))))
    for f in functions:
        if lines and rng.random() < 0.6:
            lines.append("")
        lines.append(f)
    return lines


def _render(lines: list[str | Function], swap: tuple[Function, Function] | None = None) -> str:
    out = []
    for item in lines:
        if isinstance(item, Function):
            f = swap[1] if swap and item is swap[0] else item
            out.append(f"def {f.name}({f.param}): return {f.expression}")
        else:
            out.append(item)
    return "\n".join(out) + "\n"


def _test_module(functions: list[tuple[str, Function]]) -> str:
    lines = ["import unittest\n"]
    lines += [f"from {module} import {f.name}\n" for module, f in functions]
    for _, f in functions:
        lines.append(f"\n\nclass Test{f.name.title()}(unittest.TestCase):\n    def test_{f.name}(self):\n")
        lines += [f"        self.assertEqual({f.name}({a}), {f.value(a)})\n" for a in (0, 3, 7)]
    return "".join(lines)


def _draw_package(rng: random.Random) -> tuple[dict[str, list[str | Function]], list[tuple[str, Function]]]:
    modules = rng.sample(MODULES, MODULES_PER_TASK)
    sizes = [rng.randint(*FUNCTIONS_PER_MODULE) for _ in modules]
    names = iter(rng.sample(NAMES, sum(sizes)))
    layout, functions = {}, []
    for module, size in zip(modules, sizes, strict=True):
        fs = [Function(next(names), rng.choice(PARAMS), rng.choice(OPERATORS), rng.randint(2, 9)) for _ in range(size)]
        layout[module] = _module_lines(rng, fs)
        functions += [(module, f) for f in fs]
    return layout, functions


def _write_task(folder: Path, task_id: str, rng: random.Random) -> Bug:
    layout, functions = _draw_package(rng)
    target_module, good = functions[rng.randrange(len(functions))]
    # The wrong constant also appears in another function, so a blind `s/bad/good/` over every file breaks it.
    others = [f for _, f in functions if f is not good]
    bad_constant = rng.choice([f.constant for f in others if f.constant != good.constant] or [good.constant % 9 + 2])
    bad = Function(good.name, good.param, good.op, bad_constant)
    if all(f.constant != bad_constant for f in others):
        decoy_module = next(m for m, f in functions if f is others[0])
        index = layout[decoy_module].index(others[0])
        decoy = Function(others[0].name, others[0].param, others[0].op, bad_constant)
        layout[decoy_module][index] = decoy
        functions = [(m, decoy if f is others[0] else f) for m, f in functions]
    repo = folder / "repo"
    (repo / "tests").mkdir(parents=True)
    for module, lines in layout.items():
        (repo / f"{module}.py").write_text(_render(lines, (good, bad) if module == target_module else None))
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_package.py").write_text(_test_module(functions))
    buggy = _render(layout[target_module], (good, bad))
    fixed = _render(layout[target_module])
    path = f"{target_module}.py"
    diff = difflib.unified_diff(buggy.splitlines(True), fixed.splitlines(True), f"a/{path}", f"b/{path}")
    (folder / "gold.patch").write_text("".join(diff))
    bug = Bug(target_module, layout[target_module].index(good) + 1, good.name, bad_constant, good.constant)
    (folder / "solution.sh").write_text("\n".join(bug.commands()) + "\n")
    # The name follows a space, as in `grep -n NAME`: the byte-level BPE then cuts it into the same tokens in both.
    (folder / "issue.md").write_text(f"The function {good.name} uses {bad_constant} but should use {good.constant}.\n")
    test_id = "tests.test_package.Test{}.test_{}"
    spec = {
        "id": task_id,
        "fail_to_pass": [test_id.format(good.name.title(), good.name)],
        "pass_to_pass": [test_id.format(f.name.title(), f.name) for _, f in functions if f.name != good.name],
        "oracle_turns": bug.commands(),
    }
    (folder / "task.json").write_text(json.dumps(spec, indent=2))
    return bug


def generate_locate_tasks(directory: Path, *, count: int, seed: int, split: str) -> None:
    """Write `count` locate tasks of `split` into `directory` (deterministic)."""
    rng = random.Random(seed * 7919 + SPLIT_SEEDS[split] + 17)
    for index in range(count):
        task_id = f"locate-{split}-{index:04d}"
        _write_task(directory / task_id, task_id, rng)


def locate_task_set(
    count: int = 64, seed: int = 0, split: str = "train", cache_dir: str | None = None
) -> FolderTaskSet:
    """The locate family, generated once into a cache folder and loaded from there.

    Args:
        count: tasks to generate
        seed: generator seed
        split: train or eval: the two splits never share a task
        cache_dir: where tasks are generated (default: $PATCHGYM_CACHE or the temp dir)
    """

    def generate(directory: Path, count: int, seed: int, split: str) -> None:
        generate_locate_tasks(directory, count=count, seed=seed, split=split)

    return generated_task_set(
        "locate", GENERATOR_VERSION, generate, count=count, seed=seed, split=split, cache_dir=cache_dir
    )
