"""The choices of every enumerated setting and the small helpers every section's checks use.

Here at the bottom of the config package so that the sections' checks and the modules that branch on a
choice (which import these) agree. fullmatch everywhere: a trailing newline is no valid choice.
"""
from __future__ import annotations

import re

from spes.errors import ConfigError

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda|cuda:\d+")
EXPERTS_IMPLS = ("auto", "grouped_mm", "triton", "loop")
METHODS = ("spes", "diloco", "fedavg", "centralized", "fedadam")
"""Sync methods (spes/sync/methods.py's registry builds the object for each; a test keeps the two equal)."""
CODECS = ("fp32", "bf16", "int8")
OVERLAPS = ("none", "one_round")
"""sync.overlap: whether a node trains the next round while its round is synchronised (spes/round/inputs.py)."""
DATA_ORDERS = ("epoch", "random_windows")
QK_NORMS = ("full", "head", "none")
SCHEDULES = ("cosine", "wsd")
LOSS_IMPLS = ("plain", "chunked")
NODE_PARALLEL = ("ddp", "fsdp")
EXECUTORS = ("process", "deployment")
"""How node rounds run (pipelines/executors.py holds the registry of their implementations)."""
ACTIVATION_CHECKPOINTING = ("none", "block")
FROZEN_DTYPES = ("float32", "bfloat16")
AUTOCAST_DTYPES = (None, "bfloat16", "float16")
SHARED_OUTER = ("average", "nesterov")
EXPERT_OUTER = ("owner", "nesterov")
EXPORT_ARCHS = ("auto", "qwen3", "llama")
ROUND_WINDOWS = ("spread", "first")
INIT_MODES = ("scratch", "upcycle")
CORPUS_FORMATS = ("auto", "text", "json", "parquet")
STORAGE_PROTOCOLS = ("file", "s3")
"""Where a run can live: the commit protocol needs whole writes and exclusive creates (local files, S3)."""
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Names that become folder names on storage (run names, variant names): no '/', no leading '.'."""


def check_name(value: str, key: str) -> str:
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{key}: {value!r} is not a safe name (letters, digits, '.', '_', '-'; "
                          "starting with a letter or digit; no '..')")
    return value


def need(cond: bool, msg: str) -> None:
    """The one way a check fails: a ConfigError whose message names the key."""
    if not cond:
        raise ConfigError(msg)


def check_seq(value: int, key: str, max_seq_len: int) -> None:
    need(value > 0, f"{key} must be > 0, got {value}")
    need(value <= max_seq_len, f"{key} ({value}) exceeds model.max_seq_len ({max_seq_len})")
