"""The comparison's report as markdown (artifacts/compare*/report.md), from summarize's numbers
(spes/eval/compare.py): one section per function, in the report's order; and the columns of its CSV files."""
from __future__ import annotations

import math
from typing import Optional

from spes.config.schema import Params
from spes.eval.stats import MIN_SEEDS_FOR_A_CLAIM

CSV_COLUMNS = ["variant", "budget", "seeds", "lr", "heldout_loss_mean", "heldout_loss_std", "heldout_loss_se",
               "ratio_to_centralized", "diff_to_baseline", "diff_to_baseline_se", "tokens",
               "trainable_params_per_node", "memory_bytes_per_node", "peak_bytes_per_node",
               "bytes_per_node_per_round", "wall_s", "num_experts", "state_bytes_per_node"]
PAIR_COLUMNS = ["variant", "reference", "budget", "lr", "seeds", "diff", "diff_se", "per_seed", "seed_se", "verdict",
                "doc_diff", "doc_diff_se", "doc_verdict"]


def csv_columns(rows: list[dict]) -> list[str]:
    """CSV_COLUMNS, then the metric means the rows have."""
    extra = sorted({k for row in rows for k in row if k.endswith("_mean") and k not in CSV_COLUMNS})
    return CSV_COLUMNS + extra


def _fmt_bytes(n: Optional[float]) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / 2**20:.2f}"


def _paired(d: Optional[float], se: Optional[float]) -> str:
    return "-" if d is None or se is None else f"{d:+.4f} ({se:.4f})"


def report_markdown(p: Params, summary: dict) -> str:
    """The comparison's report: the tables per budget, the paired comparisons, the sync frontier, how far the
    per-round curve can be trusted, and the learning-rate sweep."""
    c = p.compare
    out = ["# SPES vs baselines at equal tokens\n",
           f"Seeds {list(c.seeds)}, learning rates {list(c.lrs)} (best of each variant shown), budgets "
           f"{list(c.budgets)} x sync.rounds; held-out loss on the whole held-out split (mean +- std over seeds; "
           f"SE = standard error of one run's mean loss over its windows, clustered by document; the difference to "
           f"{c.baseline} is paired by seed and window; its SE is that of the seed-averaged per-window difference, "
           f"clustered by document); baseline: "
           f"{c.baseline}.\n"]
    out += _heldout_line(summary.get("heldout")) + _machines_line(summary.get("machines"))
    mem_budget = summary.get("node_memory")
    if mem_budget:
        out.append(f"\nMemory per node: at most {_fmt_bytes(mem_budget)} MiB of weights + gradients + Adam "
                   f"(compare.node_memory: {c.node_memory}); planned by spes/train/plan.py, measured = what a node's "
                   "tensors held after its last step.\n")
    out += _budget_tables(p, summary, mem_budget) + _metrics_section(summary["rows"])
    out += _pairs_section(summary) + _round_pairs_section(summary) + _reach_section(p, summary)
    out += _frontier_section(p, summary)
    out += _slice_section(summary) + _sweep_section(summary)
    return "\n".join(out) + "\n"


def _budget_tables(p: Params, summary: dict, mem_budget: Optional[float]) -> list[str]:
    c, out = p.compare, list[str]()
    for budget in c.budgets:
        out += [f"\n## Budget {budget}x\n",
                f"| variant | experts | seeds | lr | held-out loss | SE | ratio to {c.baseline} | minus {c.baseline} "
                "(paired SE) | tokens | epochs | trainable params / node | weights+grads+Adam MiB / node (planned, measured)"
                + (" | within the memory budget" if mem_budget else "") + " | MiB on the wire / node / round | wall s |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if mem_budget else "")]
        for r in (r for r in summary["rows"] if r["budget"] == budget):
            within = "" if not mem_budget else \
                f" {'yes' if r['memory_bytes_per_node'] <= mem_budget else 'no'} |"
            out.append(f"| {r['variant']} | {r.get('num_experts') or '-'} | {r['seeds']} | {r['lr']:g} | "
                       f"{r['heldout_loss_mean']:.4f} +- "
                       f"{r['heldout_loss_std']:.4f} | {r['heldout_loss_se']:.4f} | {r['ratio_to_centralized']:.4f} | "
                       f"{_paired(r['diff_to_baseline'], r['diff_to_baseline_se'])} | "
                       f"{r['tokens']} | {_epochs(r.get('epochs'))} | {r['trainable_params_per_node']} | {_fmt_bytes(r['memory_bytes_per_node'])}, "
                       f"{_fmt_bytes(r.get('state_bytes_per_node'))} |{within} "
                       f"{_fmt_bytes(r['bytes_per_node_per_round'])} | {r['wall_s']:.0f} |")
    return out


def _metrics_section(rows: list[dict]) -> list[str]:
    """The cells' other metrics by name (result.json `metrics`), means over seeds; none for cells run before."""
    names = [c[: -len("_mean")] for c in csv_columns(rows)[len(CSV_COLUMNS):]]
    if not names:
        return []
    out = ["\n## Other metrics (mean over seeds)\n", "| variant | budget | " + " | ".join(names) + " |",
           "|---|---|" + "---|" * len(names)]
    for r in rows:
        out.append(f"| {r['variant']} | {r['budget']} | "
                   + " | ".join(f"{r[n + '_mean']:.4f}" if n + "_mean" in r else "-" for n in names) + " |")
    return out


def _epochs(e: Optional[float]) -> str:
    return "-" if e is None else f"{e:.2f}"


def _heldout_line(h: Optional[dict]) -> list[str]:
    if not h:
        return []
    cap = f"at most {h['cap']} windows of a document (eval.max_windows_per_document)" if h["cap"] else \
        "every window of every document (no cap per document)"
    return [f"\nHeld-out set: {h['windows']} windows of {h['documents']} documents, {cap}; the largest document "
            f"holds {100 * h['largest_share']:.1f}% of the windows. Epochs: training tokens over the training "
            "split's (above 1, data repeats).\n"]


def _machines_line(kinds: Optional[dict]) -> list[str]:
    if not kinds:
        return []
    cells = "; ".join(f"{kind}: {n} cells" for kind, n in kinds.items())
    if len(kinds) == 1:
        return [f"\nMachine: {cells} (CPU model, the kernels torch ran, torch build).\n"]
    return [f"\n**Machines: the cells ran on {len(kinds)} kinds** ({cells}); numerics differ between CPU families, "
            "so differences between cells of different kinds include that, not only the variants'.\n"]


def _reach_section(p: Params, summary: dict) -> list[str]:
    rows = summary.get("reach")
    if not rows:
        return []
    out = ["\n## Tokens to reach a held-out loss (the per-round curve)\n",
           "Training tokens at which a run's per-round held-out loss (eval.round_batches batches) first reaches "
           "the target, interpolated between the two rounds around it: compare.target_loss, or the highest of "
           "the runs' last per-round losses at that budget (every run reaches it). Mean over seeds; '-' where a "
           f"seed never reaches it. As a multiple of {p.compare.baseline}'s.\n",
           f"| variant | budget | target loss | tokens per seed | mean | x {p.compare.baseline} |",
           "|---|---|---|---|---|---|"]
    for x in rows:
        seeds = ", ".join("-" if t is None else f"{t:.0f}" for t in x["per_seed"])
        mean = "-" if x["mean"] is None else f"{x['mean']:.0f}"
        ratio = "-" if x.get("to_baseline") is None else f"{x['to_baseline']:.2f}"
        out.append(f"| {x['variant']} | {x['budget']}x | {x['target']:.4f} | {seeds} | {mean} | {ratio} |")
    return out


def _pairs_section(summary: dict) -> list[str]:
    out: list[str] = []
    if not summary.get("pairs"):
        return out
    out += ["\n## Paired comparisons (compare.pairs: variant minus reference, same seed, lr and held-out "
            "windows)\n",
            "Beyond noise ('better'/'worse') = more than twice the document-clustered SE (of the seed-averaged "
            "per-window difference) away from zero and outside the seeds' 95% t interval (t quantile for n-1 degrees "
            f"of freedom x the SE over seeds), every seed on the same side; marked '(< {MIN_SEEDS_FOR_A_CLAIM} seeds)' "
            "with fewer seeds, which is no claim; otherwise 'within noise'.\n",
            "Per document: the same difference with every held-out document weighing the same, however many "
            "windows it has (the mean over documents of each document's mean window difference; SE over "
            "documents; the verdict by the same rule with each seed's per-document mean). Where the two "
            "columns disagree, a few long documents decide the window-weighted one.\n",
            "| variant | reference | budget | lr | seeds | difference | document-clustered SE | per seed | "
            "SE over seeds | verdict | per document | its SE | its verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in summary["pairs"]:
        seed_se, doc = _se_columns(x)
        out.append(f"| {x['variant']} | {x['reference']} | {x['budget']}x | {x['lr']:g} | {x['seeds']} | "
                   f"{x['diff']:+.4f} | {x['diff_se']:.4f} | {', '.join(f'{d:+.4f}' for d in x['per_seed'])} | "
                   f"{seed_se} | {x['verdict']} | {doc} | {x.get('doc_verdict', '-')} |")
    return out


def _se_columns(x: dict) -> tuple[str, str]:
    """A paired row's SE over seeds, and its per-document difference and SE ('-' where there are none)."""
    seed_se = "-" if x["seed_se"] is None else f"{x['seed_se']:.4f}"
    return seed_se, (f"{x['doc_diff']:+.4f} | {x['doc_diff_se']:.4f}" if x.get("doc_diff") is not None else "- | -")


def _round_pairs_section(summary: dict) -> list[str]:
    rows = summary.get("round_pairs")
    if not rows:
        return []
    out = ["\n## Paired comparisons round by round (on each round's held-out slice)\n",
           "The same differences on the slice of the held-out split scored after every round (eval.round_batches "
           "batches, eval.round_windows), for runs whose round records kept each window's loss; the same rule for "
           "a verdict.\n",
           "| variant | reference | budget | lr | round | tokens | seeds | difference | document-clustered SE | "
           "SE over seeds | verdict | per document | its SE | its verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        seed_se, doc = _se_columns(x)
        out.append(f"| {x['variant']} | {x['reference']} | {x['budget']}x | {x['lr']:g} | {x['round']} | "
                   f"{x['tokens']} | {x['seeds']} | {x['diff']:+.4f} | {x['diff_se']:.4f} | {seed_se} | "
                   f"{x['verdict']} | {doc} | {x['doc_verdict']} |")
    return out


def _frontier_section(p: Params, summary: dict) -> list[str]:
    c, out = p.compare, list[str]()
    if not summary.get("frontier"):
        return out
    out += ["\n## Sync interval: held-out loss against bytes on the wire (frontier.svg)\n",
            "Bytes each node moves (uploads and downloads) per training token it sees; fewer local steps per "
            "round buy a lower loss with more traffic.\n",
            f"| method | budget | sync_steps | seeds | held-out loss | minus {c.baseline} (paired SE) | "
            f"minus the same method at sync_steps {p.sync.every_steps} (paired SE) | bytes / node / token |",
            "|---|---|---|---|---|---|---|---|"]
    for f in summary["frontier"]:
        out.append(f"| {f['method']} | {f['budget']}x | {f['sync_steps']} | {f['seeds']} | "
                   f"{f['heldout_loss_mean']:.4f} +- {f['heldout_loss_std']:.4f} | "
                   f"{_paired(f['diff_to_baseline'], f['diff_to_baseline_se'])} | "
                   f"{_paired(f.get('diff_to_base_interval'), f.get('diff_to_base_interval_se'))} | "
                   f"{f['bytes_per_node_per_token']:.1f} |")
    return out


def _slice_section(summary: dict) -> list[str]:
    out: list[str] = []
    sl = summary.get("slice")
    if sl:
        out += ["\n## How far the per-round held-out curve can be trusted\n",
                f"The per-round held-out loss uses eval.round_batches batches ({', '.join(sl['round_windows'])} "
                f"windows). At the last round of {sl['runs']} runs it differs from the whole split's loss of the same "
                f"model by {sl['mean_diff']:+.4f} on average (at most {sl['max_abs_diff']:.4f}); it puts "
                f"{100 * sl['pairs_same_order']:.0f}% of the pairs of runs in the whole split's order.\n"]
    return out


def _sweep_section(summary: dict) -> list[str]:
    out = ["\n## Learning-rate sweep (mean held-out loss over seeds)\n", "| variant | budget | lr | loss | std |",
            "|---|---|---|---|---|"]
    for k, (mean, std) in summary["sweep"].items():
        v, b, lr = k.split("|")
        out.append(f"| {v} | {b}x | {float(lr):g} | {mean:.4f} | {std:.4f} |")
    return out
