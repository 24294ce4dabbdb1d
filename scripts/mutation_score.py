"""Mutation score: plant one-line bugs in patchgym's core, envs and pipeline, and count how many the tests catch.

Each mutant changes one thing in one module (a comparison, an arithmetic or boolean operator, a
constant, `any`/`all`, `min`/`max`, a negated `if`, a dropped call statement, a `return` of
None). It is run against that module's own test files (`MODULES`), in a private copy of the
repository, and it is killed when they fail (or run past a timeout). The share killed per module
is printed with every survivor; survivors that cannot be told apart from the original are
equivalent mutants, for a reader to judge.

    nice -n 10 python scripts/mutation_score.py                       # every module, ~25 min on 2 cores
    python scripts/mutation_score.py --since main                     # the modules changed since main
    python scripts/mutation_score.py --modules core/rollout.py --all  # every mutant of one module
    python scripts/mutation_score.py --list                           # the mutants, without running them

It spreads `--budget-min` of test time over the modules: each module gets as many (seeded,
random) mutants as its share of the budget allows at the speed of its tests, at least
`--min-per-module`. It runs outside CI (minutes, not seconds) and writes a JSON report.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
R = TypeVar("R")

MODULES: dict[str, list[str]] = {
    "core/grading.py": ["tests/test_grading.py", "tests/test_added_test_files.py", "-k", "local-none or folder"],
    "core/rollout.py": ["tests/test_rollout.py"],
    "core/losses.py": ["tests/test_losses.py"],
    "core/chat.py": ["tests/test_chat_tokens.py"],
    "core/output.py": ["tests/test_output.py"],
    "core/metrics.py": ["tests/test_metrics_report.py"],
    "envs/agent.py": ["tests/test_agent.py"],
    "envs/swe.py": ["tests/test_env.py"],
    "envs/chat_eval.py": ["tests/test_openai_eval.py"],
    "pipeline/config.py": [
        "tests/test_sft_traces.py",
        "tests/test_pipeline.py::test_misspelt_config_keys_are_clear_errors",
    ],
    "pipeline/traces.py": ["tests/test_sft_traces.py"],
    "pipeline/run.py": ["tests/test_pipeline_metrics.py"],
}
"""Module under patchgym/ -> the pytest arguments of the tests that own its behaviour."""

COMPARE = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
SWAPPED_CALLS = {"any": "all", "all": "any", "min": "max", "max": "min"}
QUIET_CALLS = ("log", "logger", "logging", "warnings", "progress", "console")
"""Receivers whose calls only report: dropping one is an equivalent mutant as far as results go."""


@dataclass
class Mutant:
    module: str
    index: int
    line: int
    what: str
    outcome: str = "not run"
    seconds: float = 0.0

    def describe(self) -> str:
        return f"{self.module}:{self.line} {self.what}"


class Mutator(ast.NodeTransformer):
    """Numbers every mutation site in traversal order; changes only site `target` (None: none)."""

    def __init__(self, target: int | None = None) -> None:
        self.target = target
        self.sites: list[tuple[int, str]] = []

    def _site(self, node: ast.AST, what: str, make: Callable[[], ast.AST]) -> ast.AST | None:
        self.sites.append((getattr(node, "lineno", 0), what))
        return make() if len(self.sites) - 1 == self.target else None

    # annotations and docstrings are not behaviour
    def visit_arg(self, node: ast.arg) -> ast.AST:
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.args.defaults = [self.visit(d) for d in node.args.defaults]
        node.args.kw_defaults = [self.visit(d) if d is not None else None for d in node.args.kw_defaults]
        node.body = self._body(node.body)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.body = self._body(node.body)
        return node

    def visit_Module(self, node: ast.Module) -> ast.AST:
        node.body = self._body(node.body)
        return node

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for i, stmt in enumerate(body):
            docstring = i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            if docstring or isinstance(stmt, ast.Import | ast.ImportFrom):
                out.append(stmt)
                continue
            new = self.visit(stmt)
            out.extend(new if isinstance(new, list) else [new])
        return out

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        return node  # messages

    # the mutations
    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        for i, op in enumerate(node.ops):
            swap = COMPARE.get(type(op))
            if swap is not None:

                def make(i: int = i, swap: type = swap) -> ast.AST:
                    node.ops[i] = swap()
                    return node

                self._site(node, f"{type(op).__name__} -> {swap.__name__}", make)
        return node

    def visit_BinOp(self, node: ast.BinOp | ast.AugAssign) -> ast.AST:
        self.generic_visit(node)
        swap = ARITHMETIC.get(type(node.op))
        if swap is not None:
            what = f"{type(node.op).__name__} -> {swap.__name__}"
            return self._site(node, what, lambda: _with_op(node, swap)) or node
        return node

    visit_AugAssign = visit_BinOp  # type: ignore[assignment]  # x += 1 -> x -= 1

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        swap = ast.Or if isinstance(node.op, ast.And) else ast.And
        return self._site(node, f"{type(node.op).__name__} -> {swap.__name__}", lambda: _with_op(node, swap)) or node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not | ast.USub):
            return self._site(node, f"drop {type(node.op).__name__}", lambda: node.operand) or node
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        value = node.value
        if isinstance(value, bool):
            return self._site(node, f"{value} -> {not value}", lambda: ast.Constant(not value)) or node
        if isinstance(value, int | float):
            return self._site(node, f"{value!r} -> {value + 1!r}", lambda: ast.Constant(value + 1)) or node
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in SWAPPED_CALLS:
            swap = SWAPPED_CALLS[node.func.id]

            def make() -> ast.AST:
                node.func = ast.Name(swap, ast.Load())
                return node

            return self._site(node, f"{node.func.id}() -> {swap}()", make) or node
        return node

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        original = node.test

        def make() -> ast.AST:
            node.test = ast.UnaryOp(ast.Not(), original)
            return node

        return self._site(node, "negate if", make) or node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        self.generic_visit(node)
        if node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None):
            return node
        return self._site(node, "return None", lambda: ast.Return(ast.Constant(None))) or node

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        self.generic_visit(node)
        call = node.value.value if isinstance(node.value, ast.Await) else node.value
        if not isinstance(call, ast.Call) or _receiver(call.func) in QUIET_CALLS:
            return node
        return self._site(node, f"drop `{ast.unparse(call)[:60]}`", lambda: ast.Pass()) or node


def _with_op(node: ast.BinOp | ast.AugAssign | ast.BoolOp, op: type) -> ast.AST:
    node.op = op()
    return node


def _receiver(func: ast.expr) -> str:
    while isinstance(func, ast.Attribute):
        func = func.value
    return func.id if isinstance(func, ast.Name) else ""


def mutants_of(module: str) -> list[Mutant]:
    tree = ast.parse((ROOT / "patchgym" / module).read_text())
    counter = Mutator()
    counter.visit(tree)
    return [Mutant(module, i, line, what) for i, (line, what) in enumerate(counter.sites)]


def mutated_source(module: str, index: int) -> str:
    tree = ast.parse((ROOT / "patchgym" / module).read_text())
    mutator = Mutator(index)
    tree = ast.fix_missing_locations(mutator.visit(copy.deepcopy(tree)))
    return ast.unparse(tree) + "\n"


def copy_repository(into: Path) -> Path:
    """A private copy of the working tree (tests resolve `patchgym` from the repository root)."""
    skip = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "runs", ".pytest_cache", "mutants")
    shutil.copytree(ROOT, into, ignore=skip)
    return into


def run_tests(repo: Path, module: str, timeout_s: float) -> tuple[str, float]:
    """'killed' when the module's tests fail or time out, 'survived' when they pass."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *MODULES[module]]
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CI", None)
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    RUNNING.add(process)
    try:
        returncode = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return "killed (timeout)", time.monotonic() - started
    finally:
        RUNNING.discard(process)
    seconds = time.monotonic() - started
    if returncode == 0:
        return "survived", seconds
    if returncode != 5:  # tests failed, or the mutant broke collection or the conftest's imports
        return "killed", seconds
    return "error (no tests ran)", seconds


RUNNING: set[subprocess.Popen[bytes]] = set()
"""Test runs in progress, stopped if the script is interrupted."""


def changed_since(ref: str) -> list[str]:
    out = subprocess.run(
        ["git", "diff", "--name-only", ref, "--", "patchgym"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [m for m in MODULES if f"patchgym/{m}" in out]


def choose(modules: Sequence[str], baseline: dict[str, float], args: argparse.Namespace) -> list[Mutant]:
    rng = random.Random(args.seed)
    share_s = args.budget_min * 60 * args.workers / max(1, len(modules))
    chosen = []
    for module in modules:
        every = mutants_of(module)
        n = len(every) if args.all else max(args.min_per_module, int(share_s / max(baseline[module], 1.0)))
        chosen += sorted(rng.sample(every, min(n, len(every))), key=lambda m: m.index)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="*", choices=list(MODULES), help="modules under patchgym/ (default: all)")
    parser.add_argument("--since", help="only the modules changed since this git ref")
    parser.add_argument("--budget-min", type=float, default=25.0, help="minutes of test time to spread over modules")
    parser.add_argument("--min-per-module", type=int, default=8)
    parser.add_argument("--all", action="store_true", help="every mutant (no budget)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-factor", type=float, default=3.0, help="a mutant's timeout: baseline x this + 30 s")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "mutation-score.json")
    args = parser.parse_args()

    modules = args.modules or list(MODULES)
    if args.since:
        modules = [m for m in modules if m in changed_since(args.since)]
    if args.list:
        for module in modules:
            for mutant in mutants_of(module):
                print(mutant.describe())
        return
    if not modules:
        print("no module to mutate")
        return

    mutants, baseline = run_all(modules, args)
    report(mutants, baseline, args.out)


def run_all(modules: list[str], args: argparse.Namespace) -> tuple[list[Mutant], dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="patchgym-mutants-") as tmp:
        repos = [copy_repository(Path(tmp) / f"worker{i}") for i in range(args.workers)]
        free = list(repos)

        def run_baseline(module: str) -> float:
            repo = free.pop()
            try:
                outcome, seconds = run_tests(repo, module, timeout_s=1800)
            finally:
                free.append(repo)
            if outcome != "survived":
                sys.exit(f"{module}: its tests fail without any mutant: fix them first ({MODULES[module]})")
            print(f"baseline {module}: {seconds:.0f} s", flush=True)
            return seconds

        baseline = dict(zip(modules, in_parallel(run_baseline, modules, args.workers), strict=True))
        mutants = choose(modules, baseline, args)
        print(f"{len(mutants)} mutants over {len(modules)} modules, {args.workers} workers", flush=True)

        def run_one(mutant: Mutant) -> Mutant:
            repo = free.pop()
            target = repo / "patchgym" / mutant.module
            original = target.read_text()
            try:
                target.write_text(mutated_source(mutant.module, mutant.index))
                timeout_s = baseline[mutant.module] * args.timeout_factor + 30
                mutant.outcome, mutant.seconds = run_tests(repo, mutant.module, timeout_s)
            finally:
                target.write_text(original)
                free.append(repo)
            return mutant

        for done, mutant in enumerate(in_parallel(run_one, mutants, args.workers), 1):
            print(f"[{done}/{len(mutants)}] {mutant.outcome:9} {mutant.describe()}", flush=True)
    return mutants, baseline


def in_parallel(work: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[R]:
    """`work` over `items` on `workers` threads, in order; on an interrupt, the test runs are stopped."""
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        yield from pool.map(work, items)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for process in list(RUNNING):
            process.kill()
        raise
    pool.shutdown()


def report(mutants: list[Mutant], baseline: dict[str, float], out: Path) -> None:
    print("\nmodule                      mutants  killed  score")
    areas: dict[str, list[Mutant]] = {}
    for module in dict.fromkeys(m.module for m in mutants):
        mine = [m for m in mutants if m.module == module]
        killed = sum(m.outcome.startswith("killed") for m in mine)
        print(f"{module:28} {len(mine):7} {killed:7} {killed / len(mine):6.0%}")
        areas.setdefault(module.split("/")[0], []).extend(mine)
    for area, mine in areas.items():
        killed = sum(m.outcome.startswith("killed") for m in mine)
        print(f"{area + '/ (all)':28} {len(mine):7} {killed:7} {killed / len(mine):6.0%}")
    survivors = [m for m in mutants if not m.outcome.startswith("killed")]
    if survivors:
        print("\nsurvivors (and errors):")
        for mutant in survivors:
            line = (ROOT / "patchgym" / mutant.module).read_text().splitlines()[mutant.line - 1].strip()
            print(f"  {mutant.describe()}  [{mutant.outcome}]\n      {line}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"baseline_s": baseline, "mutants": [asdict(m) for m in mutants]}, indent=1))
    print(f"\nreport: {out}")


if __name__ == "__main__":
    main()
