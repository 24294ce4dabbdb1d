"""A launch plan on the console: the processes in a table, each node's GPUs, the trainer's layout,
the memory estimates, then each process's command line and the environment it gets, then what the
reader must know."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from patchgym.launch.memory import GB, MemoryEstimate
from patchgym.launch.plan import LaunchPlan, ProcessPlan, spans

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


def _nodes(plan: LaunchPlan) -> list[Text]:
    """One line per node holding GPUs: how many it has, and which processes hold which (processes of
    one kind in a row shown together: sglang-engine-0..7 on GPUs 0-7)."""
    lines = []
    for node, info in plan.gpus_by_node().items():
        groups: list[tuple[str, list[str], list[int]]] = []  # (kind, processes, their GPUs)
        for gpu, name in info["held"].items():
            kind = name.rstrip("0123456789")
            if groups and groups[-1][0] == kind:
                groups[-1][1].append(name) if groups[-1][1][-1] != name else None
                groups[-1][2].append(int(gpu))
            else:
                groups.append((kind, [name], [int(gpu)]))
        if not groups:
            continue
        shown = "; ".join(
            f"{names[0]}{'..' + names[-1].removeprefix(kind) if len(names) > 1 else ''} on GPUs {spans(gpus)}"
            for kind, names, gpus in groups
        )
        lines.append(Text(f"node {node} ({'?' if info['gpus'] is None else info['gpus']} GPUs): {shown}"))
    return lines


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.0f}" if value >= 100 * GB else f"{value / GB:.1f}"


SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "weight sync": "sync",
}
"""Column names of the memory tables (they fit 80 columns)."""


def memory_table(processes: Sequence[ProcessPlan], kind: str, title: str) -> Table | None:
    """The memory estimates of `processes` (those that have one), GB per GPU, one column per part;
    processes in a row with the same node and estimate share one row (`kind` 0-7)."""
    rows: list[tuple[list[ProcessPlan], MemoryEstimate]] = []
    for p in processes:
        if p.memory is None:
            continue
        last = rows[-1][0][-1] if rows else None
        if last is not None and (last.where.node, last.memory) == (p.where.node, p.memory):
            rows[-1][0].append(p)
        else:
            rows.append(([p], p.memory))
    if not rows:
        return None
    parts = list(dict.fromkeys(k for _, m in rows for k in m.parts))
    columns = [kind, "node", *(SHORT.get(k, k) for k in parts), "total", "GPU", "use"]
    table = Table(*columns, title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for group, m in rows:
        numbers = spans([int(p.name.rsplit("-", 1)[-1]) for p in group])
        use = "-" if m.device_bytes is None else f"{m.total / m.device_bytes:.0%}"
        cells = [_gb(m.parts.get(k)) for k in parts]
        table.add_row(numbers, Text(group[0].where.node), *cells, _gb(m.total), _gb(m.device_bytes), use)
    return table


def _memory(plan: LaunchPlan) -> list[RenderableType]:
    shown: list[RenderableType] = []
    trainer = sorted((p for p in plan.processes if p.rank is not None), key=lambda p: p.rank or 0)
    ranks = memory_table(trainer, "ranks", "GPU memory per trainer rank (GB)")
    if ranks is not None:
        shown.append(ranks)
        for p in plan.processes:
            if p.memory is not None and p.memory.host:
                kept = ", ".join(f"{k} {_gb(v)} GB" for k, v in p.memory.host.items())
                shown.append(Text(f"{p.name} keeps on the host: {kept}"))
    engines = [p for p in plan.processes if p.role == "engine"]
    table = memory_table(engines, "engines", "GPU memory per engine, each of its GPUs (GB)")
    if table is not None:
        shown.append(table)
        kv = sorted({p.memory.facts["kv_tokens"] for p in engines if p.memory and "kv_tokens" in p.memory.facts})
        if kv:
            shown.append(Text(f"KV cache per engine: {' or '.join(f'{tokens:,}' for tokens in kv)} tokens"))
    return shown


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
    shown: list[RenderableType] = [table, *_nodes(plan), _layout(plan)]
    if plan.layout is not None:
        shown.append(_ranks_table(plan))
    shown += _memory(plan)
    shown.append(Text("commands, and the variables each adds to the environment it inherits:"))
    for p in plan.processes:
        shown.append(Text(p.name + (f": {'; '.join(p.runs)}" if p.runs else ""), style="bold"))
        if p.argv:
            shown.append(Text("  $ " + shlex.join(p.argv)))
        shown += [Text(f"  {key}={value}", style="cyan") for key, value in p.env.items()]
    return shown + [Text(f"note: {note}", style="yellow") for note in plan.notes]


def _ranks_table(plan: LaunchPlan) -> Table:
    table = Table("rank", "process", "node", *COORDS, title=Text("trainer ranks and their place in each group"))
    for p in sorted((p for p in plan.processes if p.rank is not None), key=lambda p: p.rank or 0):
        coords = p.coords or {}
        table.add_row(str(p.rank), Text(p.name), Text(p.where.node), *(str(coords.get(k, "-")) for k in COORDS))
    return table
