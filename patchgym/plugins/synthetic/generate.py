"""The synthetic bug generator: mutate real code, keep the bugs its own tests catch.

For each source a clean snapshot is built and its tests run once (cached under
`OUT/cache/`). Candidate mutations (see `modifiers`) are then tried in a deterministic order,
each in its own sandbox, `concurrency` at a time: a candidate is kept when at least one test
that passes on the clean snapshot fails with the bug (FAIL_TO_PASS); the tests that pass in
both runs are its PASS_TO_PASS. The kept bugs are written as a SWE-smith-style task set:

    OUT/instances.jsonl      one SWE-smith instance per line (`patch` is the BUG patch)
    OUT/snapshots/<repo>/    the clean workspace each instance starts from
    OUT/taskset.json         {"task_set": "synthetic"}: lets `patchgym tasks ... OUT` find the loader

Same sources, seed and settings → the same instances, whatever the concurrency.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress

from patchgym.core.errors import ConfigError, InfraError
from patchgym.core.sandbox import SandboxBackend, SandboxSpec
from patchgym.core.tasks import TestStatus
from patchgym.plugins.synthetic.issues import write_issue
from patchgym.plugins.synthetic.modifiers import MODIFIERS, Mutation, mutations
from patchgym.plugins.synthetic.patches import unified_diff
from patchgym.plugins.synthetic.sources import Snapshot, build_snapshot
from patchgym.plugins.synthetic.suite import SuiteRun, run_suite

INSTANCES_FILE = "instances.jsonl"
SNAPSHOTS_DIR = "snapshots"
MARKER_FILE = "taskset.json"


@dataclass(frozen=True)
class GenerateSettings:
    """Every knob of a generation run (all reported in the run's summary)."""

    seed: int = 0
    max_tasks: int = 50
    concurrency: int = 4
    hard: bool = False
    test_timeout_s: float = 300.0
    timeout_factor: float = 5.0
    min_timeout_s: float = 10.0
    max_candidates: int | None = None
    modifiers: tuple[str, ...] = tuple(MODIFIERS)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.modifiers) - set(MODIFIERS))
        if unknown:
            raise ConfigError(f"unknown bug modifiers {unknown}; known: {', '.join(MODIFIERS)}")
        if self.max_tasks < 1 or self.concurrency < 1 or min(self.test_timeout_s, self.min_timeout_s) <= 0:
            raise ConfigError("max_tasks and concurrency must be at least 1, and the timeouts positive")

    def bug_timeout_s(self, clean_duration_s: float) -> float:
        """A buggy run's time limit: `timeout_factor` × the clean run, within [min_timeout_s, test_timeout_s]."""
        return min(self.test_timeout_s, max(self.min_timeout_s, self.timeout_factor * clean_duration_s))


@dataclass
class GenerateReport:
    """What a generation run did: counts, rejection reasons and time."""

    settings: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    candidates: int = 0
    tried: int = 0
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    per_repo: Counter[str] = field(default_factory=Counter)
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in ("settings", "sources", "candidates", "tried", "accepted")}
        return data | {
            "rejected": dict(self.rejected),
            "per_repo": dict(self.per_repo),
            "duration_s": round(self.duration_s, 2),
        }


@dataclass(frozen=True)
class _Candidate:
    snapshot: Snapshot
    mutation: Mutation
    patch: str


def _clean_cache(out: Path, snapshot: Snapshot) -> Path:
    return out / "cache" / f"{snapshot.repo}.clean.json"


@dataclass(frozen=True)
class CleanRun:
    """The snapshot's test statuses without any bug, and how long the run took."""

    tests: dict[str, TestStatus]
    duration_s: float


async def clean_run(backend: SandboxBackend, snapshot: Snapshot, out: Path, timeout_s: float) -> CleanRun:
    """Run the snapshot's tests without a bug, once: the result is cached by content hash."""
    cache = _clean_cache(out, snapshot)
    if cache.is_file():
        cached = json.loads(cache.read_text())
        return CleanRun({name: TestStatus(s) for name, s in cached["tests"].items()}, cached["duration_s"])
    run = await _run_in_sandbox(backend, snapshot, None, timeout_s)
    passing = [name for name, status in run.tests.items() if status.passing]
    if run.problem or not passing:
        raise ConfigError(
            f"the tests of {snapshot.repo} do not run cleanly ({run.problem or 'no passing test'}); "
            f"command {snapshot.test_command!r}, output:\n{run.log_tail}"
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    tests = {name: str(status) for name, status in sorted(run.tests.items())}
    cache.write_text(json.dumps({"duration_s": run.duration_s, "tests": tests}, indent=1))
    return CleanRun(run.tests, run.duration_s)


async def _run_in_sandbox(
    backend: SandboxBackend, snapshot: Snapshot, mutation: Mutation | None, timeout_s: float
) -> SuiteRun:
    spec = SandboxSpec(workspace=snapshot.path, labels={"purpose": "synthetic-generate", "repo": snapshot.repo})
    async with await backend.create(spec) as sandbox:
        if mutation is not None:
            await sandbox.write_file(mutation.path, mutation.mutated)
        return await run_suite(sandbox, snapshot.test_command, timeout_s=timeout_s)


def enumerate_candidates(snapshots: Sequence[Snapshot], settings: GenerateSettings) -> list[_Candidate]:
    """Every distinct mutation of every snapshot, shuffled by seed, sources interleaved."""
    chosen = {name: MODIFIERS[name] for name in settings.modifiers}
    per_snapshot = []
    for snapshot in snapshots:
        found: dict[str, _Candidate] = {}
        for path in snapshot.source_files:
            source = (snapshot.path / path).read_text()
            for mutation in mutations(path, source, seed=settings.seed, modifiers=chosen):
                patch = unified_diff(path, mutation.original, mutation.mutated)
                found.setdefault(patch, _Candidate(snapshot, mutation, patch))
        ordered = list(found.values())
        random.Random(f"{settings.seed}:{snapshot.repo}").shuffle(ordered)
        per_snapshot.append(ordered)
    interleaved = [c for group in _round_robin(per_snapshot) for c in group]
    return interleaved[: settings.max_candidates]


def _round_robin(lists: list[list[_Candidate]]) -> list[list[_Candidate]]:
    longest = max((len(items) for items in lists), default=0)
    return [[items[i] for items in lists if i < len(items)] for i in range(longest)]


def _instance(candidate: _Candidate, clean: dict[str, TestStatus], run: SuiteRun, hard: bool) -> dict[str, Any] | None:
    passing_clean = sorted(name for name, status in clean.items() if status.passing)
    broken = [name for name in passing_clean if not (name in run.tests and run.tests[name].passing)]
    if not broken:
        return None
    snapshot, mutation = candidate.snapshot, candidate.mutation
    suffix = hashlib.sha1(candidate.patch.encode()).hexdigest()[:8]
    return {
        "instance_id": f"{snapshot.repo}.func_pm_{mutation.modifier}__{suffix}",
        "repo": snapshot.repo,
        "base_commit": snapshot.content_sha,
        "patch": candidate.patch,
        "FAIL_TO_PASS": broken,
        "PASS_TO_PASS": [name for name in passing_clean if name not in set(broken)],
        "problem_statement": write_issue(
            file=mutation.path,
            function=mutation.function,
            fail_to_pass=broken,
            messages=run.messages,
            snapshot=snapshot.path,
            hard=hard,
        ),
        "image_name": None,
        "test_command": snapshot.test_command,
        "test_paths": list(snapshot.test_paths),
        "modifier": mutation.modifier,
        "file": mutation.path,
        "function": mutation.function,
        "line": mutation.line,
    }


async def generate(
    sources: Sequence[str],
    out: Path,
    backend: SandboxBackend,
    settings: GenerateSettings,
    progress: Progress | None = None,
) -> GenerateReport:
    """Generate and write a synthetic task set from `sources` into `out`; see the module docstring."""
    started = time.perf_counter()
    if not sources:
        raise ConfigError("give at least one bug source (stdlib:MODULE, a project directory or an sdist)")
    report = GenerateReport(settings=asdict(settings))
    out.mkdir(parents=True, exist_ok=True)
    snapshots = [await asyncio.to_thread(build_snapshot, source, out / SNAPSHOTS_DIR) for source in sources]
    report.sources = {source: snapshot.repo for source, snapshot in zip(sources, snapshots, strict=True)}
    cleans = {}
    for snapshot in snapshots:
        cleans[snapshot.repo] = await clean_run(backend, snapshot, out, settings.test_timeout_s)
    candidates = await asyncio.to_thread(enumerate_candidates, snapshots, settings)
    report.candidates = len(candidates)
    tried_bar = progress.add_task("trying bugs", total=len(candidates)) if progress else None
    kept_bar = progress.add_task("tasks kept", total=settings.max_tasks) if progress else None
    accepted: dict[int, dict[str, Any]] = {}
    cursor = 0

    async def worker() -> None:
        nonlocal cursor
        while len(accepted) < settings.max_tasks and cursor < len(candidates):
            index, cursor = cursor, cursor + 1
            candidate = candidates[index]
            try:
                clean = cleans[candidate.snapshot.repo]
                timeout_s = settings.bug_timeout_s(clean.duration_s)
                run = await _run_in_sandbox(backend, candidate.snapshot, candidate.mutation, timeout_s)
            except InfraError as exc:
                report.rejected[f"infra_error:{exc.kind}"] += 1
                continue
            finally:
                report.tried += 1
                if progress and tried_bar is not None:
                    progress.advance(tried_bar)
            instance = None if run.problem else _instance(candidate, clean.tests, run, settings.hard)
            if instance is None:
                report.rejected[run.problem or "no_test_fails"] += 1
                continue
            accepted[index] = instance
            if progress and kept_bar is not None:
                progress.update(kept_bar, completed=min(len(accepted), settings.max_tasks))

    await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
    instances = [accepted[index] for index in sorted(accepted)][: settings.max_tasks]
    report.accepted = len(instances)
    report.per_repo.update(instance["repo"] for instance in instances)
    _write(out, instances)
    report.duration_s = time.perf_counter() - started
    return report


def _write(out: Path, instances: list[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(instance, sort_keys=True) + "\n" for instance in instances)
    (out / INSTANCES_FILE).write_text(lines)
    (out / MARKER_FILE).write_text(json.dumps({"task_set": "synthetic", "format": "swe-smith"}) + "\n")
