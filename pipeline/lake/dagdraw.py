"""The DAG as a picture: `moeheal plan --format dot` (Graphviz) and `--format mermaid`.

Drawn from the planned invocations of the stage declarations themselves (each
`PlannedStage` names its stage and the labels it reads), so the picture cannot
drift from what `moeheal heal` runs. Invocations of one stage are one node:
`quantize:v2:3` and `quantize:q2_k:0` are both `quantize`, labelled with how
many units it has and how many are already in the lake, because a
per-(variant, layer) graph of a real model has thousands of nodes and says
nothing more about the shape of the pipeline. A node is named by its stage,
not its label: an imported dump is `import-dump` though it is read as
`dump:calibration`.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Protocol


class Planned(Protocol):
    stage: str  # the invocation's label
    name: str  # its stage's
    status: str
    upstream: tuple[str, ...]


def stage_graph(planned: Iterable[Planned]) -> tuple[list[str], dict[str, Counter], list[tuple[str, str]]]:
    """Stages in first-seen (DAG) order, each stage's count of invocations per status, and the
    distinct edges (upstream stage, stage) between stages."""
    order: list[str] = []
    counts: dict[str, Counter] = {}
    edges: dict[tuple[str, str], None] = {}
    stage_of: dict[str, str] = {}  # label -> stage; an invocation is planned after what it reads
    for p in planned:
        kind = stage_of[p.stage] = p.name
        if kind not in counts:
            order.append(kind)
            counts[kind] = Counter()
        counts[kind][p.status] += 1
        for up in p.upstream:
            if stage_of[up] != kind:
                edges[(stage_of[up], kind)] = None
    return order, counts, list(edges)


def _caption(kind: str, count: Counter) -> str:
    total = sum(count.values())
    cached = count.get("cached", 0)
    units = f"{total} units" if total > 1 else "1 unit"
    skipped = f", {count['skipped']} skipped" if count.get("skipped") else ""
    return f"{kind}\\n{units}, {cached} cached{skipped}"


def to_dot(planned: Iterable[Planned]) -> str:
    """Graphviz source: one box per stage, filled when every invocation of it is cached (none skipped)."""
    order, counts, edges = stage_graph(planned)
    lines = ["digraph moeheal {", "  rankdir=LR;", '  node [shape=box, fontname="Helvetica"];']
    for kind in order:
        done = counts[kind].get("cached", 0) == sum(counts[kind].values())
        style = ', style=filled, fillcolor="#d9ead3"' if done else ""
        lines.append(f'  "{kind}" [label="{_caption(kind, counts[kind])}"{style}];')
    lines += [f'  "{a}" -> "{b}";' for a, b in edges]
    lines.append("}")
    return "\n".join(lines)


def to_mermaid(planned: Iterable[Planned]) -> str:
    """Mermaid flowchart source (renders in GitHub Markdown), the same graph as `to_dot`."""
    order, counts, edges = stage_graph(planned)
    ident = {kind: f"s{i}" for i, kind in enumerate(order)}
    lines = ["flowchart LR"]
    for kind in order:
        caption = _caption(kind, counts[kind]).replace("\\n", "<br/>")
        lines.append(f'  {ident[kind]}["{caption}"]')
    lines += [f"  {ident[a]} --> {ident[b]}" for a, b in edges]
    return "\n".join(lines)
