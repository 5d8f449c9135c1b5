"""Numbers for people in the Prefect UI: bytes in kB/MB/GB, seconds, losses to 4 significant digits, and the
balance of expert load (per layer: the busiest expert's share over the mean; 1.00 = perfectly balanced)."""
from __future__ import annotations

import math
from typing import Optional


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


def load_balance(counts_LE: list[list[int]]) -> list[float]:
    """Per layer: max over experts of the routed rows / their mean (1.0 when every expert gets the same)."""
    out = []
    for layer in counts_LE:
        mean = sum(layer) / len(layer) if layer else 0.0
        out.append(max(layer) / mean if mean > 0 else float("nan"))
    return out


def fmt_balance(counts_LE: list[list[int]]) -> str:
    return " ".join(f"{b:.2f}" for b in load_balance(counts_LE)) if counts_LE else "-"
