"""A launch plan on the console: the processes in a table, the trainer's layout, then each
process's command line and the environment it gets, then what the reader must know."""

from __future__ import annotations

import shlex

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from patchgym.launch.plan import LaunchPlan, spans

COORDS = ("tp", "dp", "pp", "ep", "etp", "edp")


def _layout(plan: LaunchPlan) -> Text:
    layout = plan.layout
    if layout is None:
        return Text("trainer: one process (no Megatron layout)")
    nodes = "; ".join(f"{node}: {spans(ranks)}" for node, ranks in plan.ranks_by_node().items())
    return Text(
        f"Megatron layout: {layout.world} ranks = tp {layout.tp} x pp {layout.pp} x dp {layout.dp}; "
        f"experts: ep {layout.ep} x etp {layout.etp} x expert dp {layout.expert_dp} per pipeline stage; "
        f"ranks by node: {nodes}"
    )


def _ranks_table(plan: LaunchPlan) -> Table:
    table = Table("rank", "process", "node", *COORDS, title=Text("trainer ranks and their place in each group"))
    for p in sorted((p for p in plan.processes if p.rank is not None), key=lambda p: p.rank or 0):
        coords = p.coords or {}
        table.add_row(str(p.rank), Text(p.name), Text(p.where.node), *(str(coords.get(k, "-")) for k in COORDS))
    return table


def render_plan(plan: LaunchPlan, title: str) -> list[RenderableType]:
    """The plan as rich renderables (the plan's own strings are never read as markup); print them
    with `soft_wrap=True` so that command lines go out whole."""
    table = Table(title=Text(title))
    for column in ("process", "role", "node", "host", "GPUs"):
        table.add_column(column, no_wrap=True)
    table.add_column("url", min_width=max((len(p.url or "") for p in plan.processes), default=3))
    for p in plan.processes:
        gpus = ",".join(map(str, p.where.gpus)) or "-"
        table.add_row(*(Text(x) for x in (p.name, p.role, p.where.node, p.where.host, gpus, p.url or "-")))
    shown: list[RenderableType] = [table, _layout(plan)]
    if plan.layout is not None:
        shown.append(_ranks_table(plan))
    shown.append(Text("commands, and the variables each adds to the environment it inherits:"))
    for p in plan.processes:
        shown.append(Text(p.name + (f": {'; '.join(p.runs)}" if p.runs else ""), style="bold"))
        shown.append(Text("  $ " + shlex.join(p.argv)))
        shown += [Text(f"  {key}={value}", style="cyan") for key, value in p.env.items()]
    return shown + [Text(f"note: {note}", style="yellow") for note in plan.notes]
