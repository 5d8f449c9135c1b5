"""The comparison's measures beside the final loss: the tokens each variant needs to reach a stated held-out
loss (from the per-round curve), and what the held-out set is (its documents, and the largest one's share
of the scored windows)."""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Optional

from spes.config.schema import Params


def tokens_to_reach(curve: list[dict], target: float) -> Optional[float]:
    """Training tokens at which the per-round held-out loss first reaches `target`, interpolated linearly
    between the two rounds around the crossing (the first round's tokens if it is already there; None if
    the run never gets there)."""
    before = None
    for point in curve:
        if point["heldout_loss"] <= target:
            if before is None:
                return float(point["tokens"])
            drop = before["heldout_loss"] - point["heldout_loss"]
            share = (before["heldout_loss"] - target) / drop
            return before["tokens"] + share * (point["tokens"] - before["tokens"])
        before = point
    return None


def reach_table(p: Params, rows: list[dict], runs: dict) -> list[dict]:
    """Per budget and reported (best-lr) variant: the tokens each seed needs to reach the target loss
    (compare.target_loss; else the highest of these runs' last per-round losses, which all of them reach),
    their mean, and that mean as a multiple of the baseline's. `runs`: (variant, budget, lr) -> results."""
    out = []
    for budget in p.compare.budgets:
        reported = [(r["variant"], sorted(runs[(r["variant"], budget, r["lr"])], key=lambda x: x["seed"]))
                    for r in rows if r["budget"] == budget]
        curves = [res["curve"] for _, ran in reported for res in ran if res["curve"]]
        if not curves:
            continue
        target = p.compare.target_loss or max(c[-1]["heldout_loss"] for c in curves)
        base = None
        for variant, ran in reported:
            per_seed = [tokens_to_reach(res["curve"], target) for res in ran]
            reached = [t for t in per_seed if t is not None]
            mean = statistics.fmean(reached) if len(reached) == len(per_seed) else None
            if variant == p.compare.baseline:
                base = mean
            out.append({"budget": budget, "variant": variant, "target": target, "per_seed": per_seed, "mean": mean})
        for row in out:
            if row["budget"] == budget:
                row["to_baseline"] = row["mean"] / base if row["mean"] is not None and base else None
    return out


def heldout_set(p: Params, results: list[dict]) -> Optional[dict]:
    """The scored held-out windows' documents (as the runs recorded them): how many documents and windows,
    the largest document's share of the windows, and the cap per document the windows were chosen under."""
    docs = next((r["heldout_documents"] for r in results if r.get("heldout_documents")), None)
    if not docs:
        return None
    counts = Counter(docs)
    return {"documents": len(counts), "windows": len(docs), "largest_share": max(counts.values()) / len(docs),
            "cap": p.eval.max_windows_per_document}


def machine_kinds(results: list[dict]) -> dict[str, int]:
    """How many cells ran on each machine kind (result.json's `machine`; older cells did not record it)."""
    return dict(sorted(Counter(r.get("machine") or "not recorded" for r in results).items()))
