"""The one map from settings' former names to their names now.

Until the split, one `spes` section held 24 settings of five concerns (`spes.method: fedavg` read as "SPES's
method is FedAvg"). They now live in the section of their concern: `sync` (the method, the nodes, the
schedule of rounds; what crosses the link was there already), `train` (each node's local training),
`outer` (how the nodes' mean delta becomes the global's change) and `merge` (the expert-merging warm-up).

Two readers use this map, in opposite directions:
- the loader (spes/config/loader.py): a former key in a params file or an override is refused with one line
  naming its new key;
- the run's identity (spes/run/identity.py): fingerprints keep hashing the former names, so every run made
  before the split has the same fingerprint now and resumes bitwise.
A prefix entry ("spes.optim" -> "train.optim") renames every key below it.
"""
from __future__ import annotations

from typing import Optional

RENAMED: dict[str, str] = {
    "spes.method": "sync.method",
    "spes.num_nodes": "sync.num_nodes",
    "spes.ownership": "sync.ownership",
    "spes.sync_steps": "sync.every_steps",
    "spes.rounds": "sync.rounds",
    "spes.warmup_rounds": "sync.warmup_rounds",
    "spes.token_weighted": "sync.token_weighted",
    "spes.batch_size": "train.batch_size",
    "spes.micro_batch_size": "train.micro_batch_size",
    "spes.activation_checkpointing": "train.activation_checkpointing",
    "spes.node_parallel": "train.node_parallel",
    "spes.compile": "train.compile",
    "spes.seq_len": "train.seq_len",
    "spes.seed": "train.seed",
    "spes.decayed_lb": "train.decayed_lb",
    "spes.frozen_dtype": "train.frozen_dtype",
    "spes.autocast": "train.autocast",
    "spes.optim": "train.optim",
    "spes.outer_lr": "outer.lr",
    "spes.outer_momentum": "outer.momentum",
    "spes.outer_nesterov": "outer.nesterov",
    "spes.outer_beta2": "outer.beta2",
    "spes.outer_eps": "outer.eps",
    "spes.shared_outer": "outer.shared",
    "spes.merge": "merge",
}
"""Former dotted key (or prefix) -> its name now."""

FORMER_NAMES = {new: old for old, new in RENAMED.items()}
SPLIT_SECTIONS = ("sync", "train", "outer", "merge")
"""The sections the former `spes` section was split into."""


def _translate(key: str, table: dict[str, str]) -> Optional[str]:
    for prefix, to in table.items():
        if key == prefix or key.startswith(prefix + "."):
            return to + key[len(prefix):]
    return None


def new_name(former: str) -> Optional[str]:
    """The key now of a former key (None if it was not renamed)."""
    return _translate(former, RENAMED)


def former_name(key: str) -> str:
    """The name a key had before the split (itself if it was not renamed)."""
    return _translate(key, FORMER_NAMES) or key
