"""The `acme-ledger` task set: tasks generated in code, each graded by its own `Grader`.

A task's workspace is the shared ACME ledger folder (shipped with this package); its setup
command writes that task's `invoices.txt`, one `<item> <amount>` per line. The agent must write
the sum of the amounts to `total.txt`. The grader knows the right total from generation time,
so nothing the agent changes in the sandbox (the invoices included) can move it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from patchgym.core.errors import ConfigError
from patchgym.core.sandbox import Sandbox, SandboxSpec
from patchgym.core.tasks import Grade, Grader, Task, TaskSet, TestStatus

WORKSPACE = Path(__file__).with_name("workspace")
INVOICES, TOTAL = "invoices.txt", "total.txt"
ITEMS = ("anvil", "rocket", "magnet", "spring", "catapult", "tornado-kit", "glue", "skates", "dynamite", "umbrella")
INSTRUCTION = (
    "The ACME ledger needs this quarter's total.\n"
    f"Add up the amounts (the second column) in `{INVOICES}` and write the total, a single integer, to `{TOTAL}`.\n"
)


class LedgerTotalGrader(Grader):
    """Reward 1 when `total.txt` holds `expected` (surrounding whitespace ignored), else 0."""

    def __init__(self, expected: int) -> None:
        self.expected = expected

    async def grade(self, sandbox: Sandbox) -> Grade:
        try:
            written = (await sandbox.read_file(TOTAL)).decode(errors="replace").strip()
        except FileNotFoundError:
            return self._verdict(False, f"{TOTAL} is missing")
        if written == str(self.expected):
            return self._verdict(True, "the total is right")
        return self._verdict(False, f"{TOTAL} holds {written[:40]!r}, which is not the total")

    @staticmethod
    def _verdict(resolved: bool, reason: str) -> Grade:
        status = TestStatus.PASSED if resolved else TestStatus.FAILED
        return Grade(reward=float(resolved), resolved=resolved, tests={"total": status}, details={"reason": reason})


def _gold_patch(total: int) -> str:
    """The reference solution as a unified diff that creates total.txt."""
    return f"--- /dev/null\n+++ b/{TOTAL}\n@@ -0,0 +1 @@\n+{total}\n"


def make_task(task_id: str, invoices: list[tuple[str, int]]) -> Task:
    """One ledger task over these invoices."""
    listing = "".join(f"{item} {amount}\n" for item, amount in invoices)
    total = sum(amount for _, amount in invoices)
    return Task(
        id=task_id,
        instruction=INSTRUCTION,
        sandbox=SandboxSpec(workspace=WORKSPACE, labels={"task_id": task_id}),
        grader=LedgerTotalGrader(total),
        setup_commands=(f"cat > {INVOICES} <<'ACME_EOF'\n{listing}ACME_EOF",),
        gold_patch=_gold_patch(total),
        metadata={"invoices": len(invoices)},
    )


class LedgerTaskSet(TaskSet):
    """`count` ledger tasks of `lines` invoices each, the same for the same seed.

    Registered as the factory itself: patchgym passes a task set's options as keyword arguments.
    """

    def __init__(self, count: int = 8, seed: int = 0, lines: int = 5) -> None:
        if count < 1 or lines < 1:
            raise ConfigError(f"acme-ledger needs count >= 1 and lines >= 1, got count={count}, lines={lines}")
        self.name = "acme-ledger"
        rng = random.Random(seed)
        self._tasks = [
            make_task(f"acme-ledger-{seed}-{i:03d}", [(rng.choice(ITEMS), rng.randint(1, 999)) for _ in range(lines)])
            for i in range(count)
        ]

    def __iter__(self) -> Iterator[Task]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)
