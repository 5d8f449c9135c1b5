"""Numbers for people in the Prefect UI: bytes in kB/MB/GB, seconds, losses to 4 significant digits, and the
balance of expert load (per layer: the busiest expert's share over the mean; 1.00 = perfectly balanced)."""
from __future__ import annotations

import math
from typing import Optional

from spes.model.losses import load_balance


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
    if s >= 60:
        return f"{int(s // 60)} min {s % 60:02.0f} s"
    return f"{s:.3g} s"


def fmt_loss(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def fmt_metrics(metrics: dict) -> str:
    """A round's named metrics for its table's description: ', heldout_accuracy 0.3125, ...' ('' without)."""
    return "".join(f", {name} {fmt_loss(v)}" for name, v in sorted(metrics.items()))


def fmt_experts(experts) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, run = [], []
    for e in sorted(experts):
        if run and e != run[-1] + 1:
            out.append(run)
            run = []
        run.append(e)
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out) or "none"


def fmt_balance(counts_LE: list[list[int]]) -> str:
    """'L0 1.47 · L1 1.68': each layer's max/mean expert load, labelled by layer."""
    return " · ".join(f"L{i} {b:.2f}" for i, b in enumerate(load_balance(counts_LE))) if counts_LE else "-"


BLOCKS = "▁▂▃▄▅▆▇█"
SHADES = " ░▒▓█"


def sparkline(values: list[float]) -> str:
    """The values as one line of block characters, lowest ▁ to highest █ (plain text: every markdown renders it)."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int((v - lo) / span * len(BLOCKS)))] for v in values)


def load_heatmap(counts_by_node: dict[int, list[list[int]]]) -> str:
    """Markdown: per layer, a row per node and a cell per expert shaded by the share of the node's routed rows
    that went to it (░ little ... █ most), with the shares in percent beside: what MoE researchers look at
    first (is the routing collapsing?)."""
    if not counts_by_node:
        return "no expert load recorded"
    first = next(iter(counts_by_node.values()))
    layers, experts = len(first), len(first[0]) if first else 0
    width = max(2, len(str(max(experts - 1, 0))))
    header = (f"{'expert':<{len('node ') + len(str(max(counts_by_node)))}} |"
              + "".join(f"{e:>{width}}" for e in range(experts)) + "| "
              + " ".join(f"{'e' + str(e):>4}" for e in range(experts)) + "  (% of the node's routed rows)")
    out = []
    for layer in range(layers):
        out.append(f"layer {layer}:\n```")
        out.append(header)
        for node, counts in sorted(counts_by_node.items()):
            row = counts[layer]
            total = sum(row) or 1
            shares = [c / total for c in row]
            top = max(shares) or 1.0
            cells = "".join(SHADES[min(len(SHADES) - 1, round(s / top * (len(SHADES) - 1)))] * width for s in shares)
            out.append(f"node {node} |{cells}| " + " ".join(f"{100 * s:4.1f}" for s in shares))
        out.append("```")
    return "\n".join(out)
