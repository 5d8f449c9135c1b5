"""SPES against its baselines at equal tokens: the variant matrix and the report arithmetic (no I/O).

A *variant* is a named list of `key=value` overrides of params.yaml (`compare.variants`); the matrix is
variants x `compare.seeds` x `compare.lrs` x `compare.budgets` (multiples of sync.rounds). Every run starts
from the same tokens and the same initial model (a variant with another expert count: the same init recipe
on the same dense model), and every variant trains on the same number of tokens: overrides that would change
the data, the init recipe or the token count are refused before anything trains.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spes.config.loader import params_from_dict, to_dict
from spes.config.schema import Params, check_name
from spes.errors import ConfigError
from spes.eval.measures import heldout_set, machine_kinds, reach_table
from spes.eval.stats import (
    mean_std,
    paired_difference,
    paired_difference_by_document,
    seed_differences,
    seed_se,
    verdict,
)
from spes.sync.methods import sync_method

FIXED_PREFIXES = ("tokenize.", "init.", "dense.", "storage.", "artifacts_dir", "orchestration.run_name", "compare.",
                  "eval.")
"""What a variant may not override: the data, the initial model, where results go, how they are scored."""
MODEL_MATH_KEYS = ("lb_loss_coef", "z_loss_coef", "z_loss_reduction", "lm_head_z_loss_coef", "experts_impl",
                   "num_experts")
"""The only model settings a variant may change: losses, implementation, and the expert count (whose initial
model the init recipe makes anew from the same dense model: equal memory per node, compare.node_memory)."""


def nodes_and_batch(p: Params) -> tuple[int, int]:
    """How many nodes train a variant, and the sequences each takes per step (its sync method's plan)."""
    m = sync_method(p)
    return m.nodes, m.node_batch_size


def run_tokens(p: Params) -> int:
    nodes, batch = nodes_and_batch(p)
    return nodes * batch * p.train.seq_len * p.sync.every_steps * p.sync.rounds


@dataclass(frozen=True)
class Cell:
    variant: str
    seed: int
    lr: float
    budget: int

    @property
    def key(self) -> str:  # what DVC's matrix calls the stage: <variant>-<seed>-<lr>-<budget>
        return f"{self.variant}-{self.seed}-{self.lr}-{self.budget}"

    @property
    def run_name(self) -> str:
        return f"cmp-{self.key}"


def _check_override(variant: str, item: str) -> str:
    if "=" not in item:
        raise ConfigError(f"compare.variants.{variant}: {item!r} is not key=value")
    key = item.split("=", 1)[0].strip()
    if key.startswith(FIXED_PREFIXES) or (key.startswith("model.") and key.split(".", 1)[1] not in MODEL_MATH_KEYS):
        raise ConfigError(f"compare.variants.{variant}: {key} may not differ between variants (same tokens, same "
                          "initial model, same scoring)")
    return item


def variant_params(p: Params, variant: str, seed: Optional[int] = None, lr: Optional[float] = None,
                   budget: int = 1) -> Params:
    """Params of one run: the base with the variant's overrides, then seed, learning rate and budget."""
    overrides = [_check_override(variant, o) for o in p.compare.variants[variant]]
    try:
        merged = OmegaConf.merge(OmegaConf.create(to_dict(p)), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"compare.variants.{variant}: {str(e).splitlines()[0]}") from None
    d: Any = OmegaConf.to_container(merged)
    if seed is not None:
        d["train"]["seed"] = seed
    if lr is not None:
        d["train"]["optim"]["lr"] = lr
    d["sync"]["rounds"] *= budget
    try:
        return params_from_dict(d)  # unknown keys and bad values fail here, naming the key
    except ConfigError as e:
        raise ConfigError(f"compare.variants.{variant}: {e}") from None


def check_matrix(p: Params) -> dict[str, Params]:
    """Every variant resolved (once, at the base seed/lr/budget); one-line errors for a bad override, a
    duplicate or unsafe name, a missing baseline, or a variant that trains on a different number of tokens."""
    c = p.compare
    if not c.variants:
        raise ConfigError("compare.variants is empty")
    for name in c.variants:
        check_name(name, f"compare.variants.{name}")
    if c.baseline not in c.variants:
        raise ConfigError(f"compare.baseline {c.baseline!r} is not one of compare.variants {sorted(c.variants)}")
    for variant, reference in c.pair_list():
        if variant not in c.variants or reference not in c.variants or variant == reference:
            raise ConfigError(f"compare.pairs.{variant}: {variant!r} -> {reference!r} must name two different "
                              f"variants of compare.variants {sorted(c.variants)}")
    if not c.seeds or not c.lrs or not c.budgets:
        raise ConfigError("compare.seeds, compare.lrs and compare.budgets must each list at least one value")
    if any(lr <= 0 for lr in c.lrs) or any(b < 1 for b in c.budgets) or len(set(c.seeds)) != len(c.seeds):
        raise ConfigError("compare.lrs must be > 0, compare.budgets >= 1, compare.seeds distinct")
    resolved = {name: variant_params(p, name) for name in c.variants}
    want = run_tokens(p)
    for name, vp in resolved.items():
        if run_tokens(vp) != want:
            raise ConfigError(f"compare.variants.{name} trains on {run_tokens(vp)} tokens, the others on {want}: "
                              "variants are compared at equal tokens (nodes x batch x seq_len x steps)")
    return resolved


def cells(p: Params) -> list[Cell]:
    c = p.compare
    return [Cell(v, s, lr, b) for v in c.variants for s in c.seeds for lr in c.lrs for b in c.budgets]


# -- the report's arithmetic (its statistics: spes/eval/stats.py; its text: spes/eval/report.py) ----------
def summarize(p: Params, results: list[dict]) -> dict:
    """Per (variant, budget): the best learning rate's mean and spread over seeds, and everything the table
    shows; plus the sweep and the merging effect. `results` are the runs' result.json dicts."""
    by: dict[tuple, list[dict]] = {}
    for res in results:
        by.setdefault((res["variant"], res["budget"], res["lr"]), []).append(res)
    sweep = {k: mean_std([r["heldout_loss"] for r in v]) for k, v in by.items()}
    rows = []
    for budget in p.compare.budgets:
        base_loss = None
        best = {}
        for variant in p.compare.variants:
            lrs = [lr for (v, b, lr) in sweep if v == variant and b == budget]
            if not lrs:
                continue
            lr = min(lrs, key=lambda x: sweep[(variant, budget, x)][0])
            best[variant] = lr
        if p.compare.baseline in best:
            base_loss = sweep[(p.compare.baseline, budget, best[p.compare.baseline])][0]
        for variant, lr in best.items():
            runs = sorted(by[(variant, budget, lr)], key=lambda r: r["seed"])
            mean, std = sweep[(variant, budget, lr)]
            base_runs = by.get((p.compare.baseline, budget, best.get(p.compare.baseline)), [])
            diff, diff_se = paired_difference(runs, base_runs)
            rows.append({
                "variant": variant, "budget": budget, "lr": lr, "seeds": len(runs),
                "heldout_loss_mean": mean, "heldout_loss_std": std,
                "heldout_loss_se": statistics.fmean(r["heldout_se"] for r in runs),
                "ratio_to_centralized": mean / base_loss if base_loss else float("nan"),
                "diff_to_baseline": diff, "diff_to_baseline_se": diff_se,
                "tokens": runs[0]["tokens"], "trainable_params_per_node": runs[0]["trainable_params_per_node"],
                "epochs": runs[0]["tokens"] / runs[0]["train_tokens"] if runs[0].get("train_tokens") else None,
                "memory_bytes_per_node": runs[0]["memory_bytes_per_node"],
                "peak_bytes_per_node": runs[0].get("peak_bytes_per_node"),
                "state_bytes_per_node": runs[0].get("state_bytes_per_node"),
                "num_experts": runs[0].get("num_experts"),
                "bytes_per_node_per_round": statistics.fmean(r["bytes_per_node_per_round"] for r in runs),
                "wall_s": statistics.fmean(r["wall_s"] for r in runs), **metric_means(runs)})
    return {"rows": rows, "sweep": {f"{v}|{b}|{lr}": ms for (v, b, lr), ms in sorted(sweep.items())},
            "pairs": paired_comparisons(p, by), "round_pairs": round_pairs(p, by),
            "frontier": frontier(p, rows, by), "slice": slice_agreement(results), "reach": reach_table(p, rows, by),
            "heldout": heldout_set(p, results), "machines": machine_kinds(results)}


def metric_means(runs: list[dict]) -> dict[str, float]:
    """'<name>_mean' over seeds of each metric every run has (result.json `metrics`, by name: a run made
    before a metric existed leaves it out of the row)."""
    names = set.intersection(*(set(r.get("metrics") or {}) for r in runs)) if runs else set()
    return {f"{n}_mean": statistics.fmean(r["metrics"][n] for r in runs) for n in sorted(names)}


def paired_comparisons(p: Params, runs: dict) -> list[dict]:
    """compare.pairs: per pair, budget and learning rate both ran, variant minus reference paired by seed and
    held-out window (`runs`: (variant, budget, lr) -> results): the mean difference, its document-clustered SE,
    each seed's difference, their SE over seeds and the verdict; and the same with every held-out document
    weighing the same (`doc_*`: its mean, SE over documents and verdict)."""
    out = []
    for variant, reference in p.compare.pair_list():
        for budget in p.compare.budgets:
            for lr in p.compare.lrs:
                ran = sorted(runs.get((variant, budget, lr), []), key=lambda r: r["seed"])
                row = _paired(ran, runs.get((reference, budget, lr), []))
                if row is not None:
                    out.append({"variant": variant, "reference": reference, "budget": budget, "lr": lr, **row})
    return out


def _paired(ran: list[dict], ref: list[dict]) -> Optional[dict]:
    """`ran` minus `ref` paired by seed and window: the difference, its SEs, each seed's, the verdicts (None
    for no seed in common)."""
    seeds = seed_differences(ran, ref)
    if not seeds:
        return None
    diff, se = paired_difference(ran, ref)
    doc_diff, doc_se, doc_seeds = paired_difference_by_document(ran, ref)
    per_seed = [d for d, _ in seeds]
    return {"seeds": len(per_seed), "diff": diff, "diff_se": se, "per_seed": per_seed, "seed_se": seed_se(per_seed),
            "verdict": verdict(diff, se, per_seed), "doc_diff": doc_diff, "doc_diff_se": doc_se,
            "doc_verdict": verdict(doc_diff, doc_se, doc_seeds) if doc_seeds else "-"}


def round_pairs(p: Params, runs: dict) -> list[dict]:
    """compare.pairs round by round, on each round's held-out slice (eval.round_windows), for the runs whose
    round records kept each window's loss: variant minus reference paired by seed and window, the SE of the
    seed-averaged difference clustered by document, and the same with every document weighing the same."""
    out = []
    for (variant, reference), budget, lr in ((pair, b, lr) for pair in p.compare.pair_list()
                                             for b in p.compare.budgets for lr in p.compare.lrs):
        ran, ref = runs.get((variant, budget, lr), []), runs.get((reference, budget, lr), [])
        for rnd in sorted({pt["round"] for r in ran for pt in r.get("curve", []) if pt.get("windows")}):
            a = [x for x in (_round_slice(r, rnd) for r in sorted(ran, key=lambda r: r["seed"])) if x]
            row = _paired(a, [x for x in (_round_slice(r, rnd) for r in ref) if x])
            if row is not None:
                out.append({"variant": variant, "reference": reference, "budget": budget, "lr": lr, "round": rnd,
                            "tokens": a[0]["tokens"], **row})
    return out


def _round_slice(result: dict, rnd: int) -> Optional[dict]:
    """A run's round `rnd` as paired_difference reads a run: its slice's per-window losses and their documents."""
    pt = next((pt for pt in result.get("curve", []) if pt["round"] == rnd and pt.get("windows")), None)
    return None if pt is None else {"seed": result["seed"], "heldout_windows": pt["windows"], "tokens": pt["tokens"],
                                    "heldout_documents": result.get("round_window_documents")}


def slice_agreement(results: list[dict]) -> Optional[dict]:
    """How far the per-round held-out loss (a slice of the split: eval.round_batches batches) can be trusted:
    over the runs whose result names its windows, the slice's value at the last round against the whole
    split's loss of the same model: the mean and largest difference, and the share of pairs of runs both put
    in the same order. None with fewer than two such runs."""
    pts = [(r["curve"][-1]["heldout_loss"], r["heldout_loss"], r["round_windows"]) for r in results
           if r.get("round_windows") and r.get("curve") and r["curve"][-1]["round"] == r["rounds"]]
    if len(pts) < 2:
        return None
    diffs = [a - b for a, b, _ in pts]
    pairs = [(i, j) for i in range(len(pts)) for j in range(i + 1, len(pts))]
    same = sum(1 for i, j in pairs if (pts[i][0] - pts[j][0]) * (pts[i][1] - pts[j][1]) > 0)
    return {"round_windows": sorted({w for _, _, w in pts}), "runs": len(pts), "mean_diff": statistics.fmean(diffs),
            "max_abs_diff": max(abs(d) for d in diffs), "pairs_same_order": same / len(pairs)}


def has_frontier(resolved: dict[str, Params]) -> bool:
    """Whether the multi-node variants of a matrix (`check_matrix`'s) sync at more than one interval (the report
    then plots loss against traffic, frontier.svg)."""
    intervals = {vp.sync.every_steps for vp in resolved.values() if nodes_and_batch(vp)[0] > 1}
    return len(intervals) > 1


def frontier(p: Params, rows: list[dict], runs: Optional[dict] = None) -> list[dict]:
    """Held-out loss against communication, when the variants sync at different intervals: per summary row of
    a method with several nodes, its sync interval and the bytes each node moves (up and down) per training
    token it sees (bytes per node per round x rounds / tokens per node); with `runs` ((variant, budget, lr)
    -> results), its paired difference to the same method at params.yaml's interval. Empty with one
    interval."""
    out = []
    for r in rows:
        vp = variant_params(p, r["variant"], budget=r["budget"])
        nodes = nodes_and_batch(vp)[0]
        if nodes < 2:  # one node: nothing between nodes to trade against
            continue
        label = (vp.sync.method + ("+nesterov" if vp.outer.shared == "nesterov" else "")
                 + ("+avgopt" if vp.sync.average_optimizer_state else ""))
        out.append({"variant": r["variant"], "budget": r["budget"], "lr": r["lr"], "method": label,
                    "sync_steps": vp.sync.every_steps, "heldout_loss_mean": r["heldout_loss_mean"],
                    "heldout_loss_std": r["heldout_loss_std"], "seeds": r["seeds"],
                    "diff_to_baseline": r["diff_to_baseline"], "diff_to_baseline_se": r["diff_to_baseline_se"],
                    "bytes_per_node_per_token": r["bytes_per_node_per_round"] * vp.sync.rounds
                    / (r["tokens"] / nodes)})
    if len({x["sync_steps"] for x in out}) < 2:
        return []
    for x in out:  # against the same method at the base interval (paired by seed and window), each at its best lr
        same = [y for y in out if (y["method"], y["budget"], y["sync_steps"]) ==
                (x["method"], x["budget"], p.sync.every_steps)]
        x["diff_to_base_interval"], x["diff_to_base_interval_se"] = None, None
        if runs is not None and same:
            base = same[0]
            x["diff_to_base_interval"], x["diff_to_base_interval_se"] = paired_difference(
                runs[(x["variant"], x["budget"], x["lr"])], runs[(base["variant"], base["budget"], base["lr"])])
    return sorted(out, key=lambda x: (x["budget"], x["method"], x["sync_steps"]))
