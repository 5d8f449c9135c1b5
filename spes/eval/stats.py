"""The comparison's statistics (no I/O): standard errors clustered by document, differences paired by seed and
window, and the verdict of a paired comparison. Tested against hand computations (tests/spes/eval/)."""
from __future__ import annotations

import math
import statistics
from typing import Optional

from spes.errors import DataError


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def clustered_se(values: list[float], clusters: Optional[list[int]] = None) -> float:
    """Standard error of the mean of `values`, clustered by `clusters` (windows of one document share its
    topic and style: treating them as independent understated the SE about 10x on the default held-out split).
    Sandwich estimator with the G/(G-1) correction; without clusters, every value its own cluster."""
    n = len(values)
    if n < 2:
        return 0.0
    clusters = clusters if clusters is not None else list(range(n))
    if len(clusters) != n:
        raise DataError(f"{n} values but {len(clusters)} cluster labels")
    mean = statistics.fmean(values)
    sums: dict[int, float] = {}
    for v, g in zip(values, clusters):
        sums[g] = sums.get(g, 0.0) + (v - mean)
    groups = len(sums)
    if groups < 2:
        return float("nan")
    return math.sqrt(groups / (groups - 1) * sum(s * s for s in sums.values())) / n


def seed_differences(runs: list[dict], base_runs: list[dict]) -> list[tuple[float, float]]:
    """Per seed both ran (in `runs`' order) with the same held-out windows: the mean of (loss - baseline loss)
    over the windows and its standard error, clustered by document (`heldout_documents`; results written
    before they were recorded fall back to independent windows, which understates it)."""
    return [(statistics.fmean(d), clustered_se(d, docs)) for d, docs in _paired_windows(runs, base_runs)]


def paired_difference(runs: list[dict], base_runs: list[dict]) -> tuple[Optional[float], Optional[float]]:
    """Over the seeds both ran on the same held-out windows: the mean of (loss - baseline loss) and the SE of
    the seed-averaged per-window difference, clustered by document; (None, None) for no seed in common.

    Every seed is scored on the same held-out documents, so a document's effect is shared by the seeds:
    averaging each window's difference over the seeds first, then clustering by document, keeps that
    correlation in (combining per-seed SEs as if each seed had its own documents, sqrt(sum se_s^2)/n,
    understated the SE up to 1.6x on the committed studies)."""
    pairs = _paired_windows(runs, base_runs)
    if not pairs:
        return None, None
    averaged, docs = _seed_averaged(pairs)
    return statistics.fmean(averaged), clustered_se(averaged, docs)


def paired_difference_by_document(runs: list[dict], base_runs: list[dict]) -> tuple[Optional[float], Optional[float], list[float]]:
    """The same comparison with every held-out document weighing the same, however many windows it has (a few
    long files hold most of the windows of the default split): per document, the mean over its windows of the
    seed-averaged difference; their mean, its SE over documents, and each seed's per-document mean. None, None
    and [] without the windows' documents (results written before they were recorded)."""
    pairs = _paired_windows(runs, base_runs)
    if not pairs or any(docs is None for _, docs in pairs):
        return None, None, []
    averaged, docs = _seed_averaged(pairs)
    assert docs is not None

    def by_document(values: list[float]) -> list[float]:
        groups: dict[int, list[float]] = {}
        for v, g in zip(values, docs):
            groups.setdefault(g, []).append(v)
        return [statistics.fmean(groups[g]) for g in sorted(groups)]

    per_doc = by_document(averaged)
    if len(per_doc) < 2:
        return statistics.fmean(per_doc), float("nan"), []
    se = statistics.stdev(per_doc) / math.sqrt(len(per_doc))
    return statistics.fmean(per_doc), se, [statistics.fmean(by_document(d)) for d, _ in pairs]


def _seed_averaged(pairs: list[tuple[list[float], Optional[list[int]]]]) -> tuple[list[float], Optional[list[int]]]:
    """Each window's difference averaged over the seeds, and the windows' documents (None where no result
    recorded them); the seeds must have been scored on the same windows of the same documents."""
    width = len(pairs[0][0])
    if any(len(d) != width for d, _ in pairs):
        raise DataError(f"the seeds were scored on different held-out windows ({sorted({len(d) for d, _ in pairs})} "
                        "windows): a seed-averaged difference needs the same split")
    docs = [g for _, g in pairs if g is not None]
    if any(g != docs[0] for g in docs):
        raise DataError("the seeds' held-out windows belong to different documents: not the same split")
    return [statistics.fmean(d[w] for d, _ in pairs) for w in range(width)], docs[0] if docs else None


def _paired_windows(runs: list[dict], base_runs: list[dict]) -> list[tuple[list[float], Optional[list[int]]]]:
    """Per seed both ran (in `runs`' order) on the same windows: the per-window differences and the windows'
    documents (None for results written before they were recorded: independent windows, which understates)."""
    base = {r["seed"]: r for r in base_runs}
    out = []
    for r in runs:
        b = base.get(r["seed"])
        if b is None or not r.get("heldout_windows") or len(r["heldout_windows"]) != len(b.get("heldout_windows") or []):
            continue
        out.append(([x - y for x, y in zip(r["heldout_windows"], b["heldout_windows"])], r.get("heldout_documents")))
    return out


def seed_se(per_seed: list[float]) -> Optional[float]:
    """Standard error of the mean of the seeds' differences (None with one seed)."""
    return statistics.stdev(per_seed) / math.sqrt(len(per_seed)) if len(per_seed) > 1 else None


def _t_within(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with `df` degrees of freedom (the closed forms for integer df)."""
    theta = math.atan(t / math.sqrt(df))
    c2, total, term = math.cos(theta) ** 2, 1.0, 1.0
    if df % 2 == 1:
        if df == 1:
            return 2 * theta / math.pi
        for k in range(1, (df - 1) // 2):
            term *= 2 * k / (2 * k + 1) * c2
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    for k in range(1, df // 2):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return math.sin(theta) * total


def t_quantile(df: int, level: float = 0.95) -> float:
    """The two-sided `level` quantile of Student's t with `df` degrees of freedom (df 1: 12.706, 3: 3.182)."""
    if df < 1 or not 0 < level < 1:
        raise DataError(f"t quantile: needs df >= 1 and a level in (0, 1), got df={df}, level={level}")
    lo, hi = 0.0, 1.0
    while _t_within(hi, df) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_within(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


MIN_SEEDS_FOR_A_CLAIM = 4
"""Fewer seeds than this, a difference beyond noise is reported as such but marked: not a claim."""


def verdict(diff: Optional[float], se: Optional[float], per_seed: list[float]) -> str:
    """'better' or 'worse' only when the difference is beyond both kinds of noise: more than twice its
    document-clustered SE (which windows were scored) and beyond the 95% t interval of the seeds' mean
    (t quantile for n-1 degrees of freedom times the SE over seeds: how training went), with every seed on
    the same side; marked '(< 4 seeds)' with fewer seeds than MIN_SEEDS_FOR_A_CLAIM; else 'within noise'
    ('one seed' where the second kind is unknown)."""
    if diff is None or se is None:
        return "-"
    over_seeds = seed_se(per_seed)
    if over_seeds is None:
        return "one seed"
    same_side = all(d < 0 for d in per_seed) or all(d > 0 for d in per_seed)
    if same_side and abs(diff) > 2 * se and abs(diff) > t_quantile(len(per_seed) - 1) * over_seeds:
        word = "better" if diff < 0 else "worse"
        return word if len(per_seed) >= MIN_SEEDS_FOR_A_CLAIM else f"{word} (< {MIN_SEEDS_FOR_A_CLAIM} seeds)"
    return "within noise"
