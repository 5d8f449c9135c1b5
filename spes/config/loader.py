"""Reading and validating `params.yaml`: the one place a configuration is checked.

`load_params` merges the YAML (after the file it `include`s, if any: the presets under configs/) and
`key=value` overrides onto the schema in `spes/config/schema.py`, so
unknown keys and wrong types fail at load time; `validate` then checks every cross-field invariant
and returns one-line errors naming the key, before any compute or any write to storage. It reads no
files besides the params file itself (deployment nodes re-validate and hold no corpus).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spes.config.ownership import Ownership, planned_changes
from spes.config.schema import (
    CODECS,
    DATA_ORDERS,
    DEVICE_PATTERN,
    EXPERTS_IMPLS,
    LOSS_IMPLS,
    METHODS,
    NODE_PARALLEL,
    SCHEDULES,
    OptimConfig,
    Params,
    check_name,
)
from spes.errors import ConfigError, OwnershipError

DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

REPLACED = {"compare.variants": ("compare.variants", "compare.pairs"), "compare.pairs": ("compare.pairs",)}
"""Settings an including file replaces whole instead of merging into, and what each replaces: the pairs name
variants, so new variants drop the included pairs as well (see _load_with_includes)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_optim(o: OptimConfig, key: str) -> None:
    _need(o.schedule in SCHEDULES, f"{key}.schedule must be one of {'|'.join(SCHEDULES)}, got {o.schedule!r}")
    _need(0.0 < o.decay_fraction <= 1.0, f"{key}.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    _need(o.lr > 0, f"{key}.lr must be > 0, got {o.lr}")
    _need(0.0 <= o.min_lr_ratio <= 1.0, f"{key}.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _need(o.warmup_steps >= 0, f"{key}.warmup_steps must be >= 0, got {o.warmup_steps}")
    _need(o.weight_decay >= 0, f"{key}.weight_decay must be >= 0, got {o.weight_decay}")
    _need(0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0, f"{key}.beta1/beta2 must be in [0, 1)")
    _need(o.grad_clip >= 0, f"{key}.grad_clip must be >= 0 (0 = off), got {o.grad_clip}")


def _check_model(p: Params) -> None:
    m = p.model
    _need(m.vocab_size > 0, f"model.vocab_size must be > 0, got {m.vocab_size}")
    _need(m.hidden_size > 0 and m.num_layers > 0, "model.hidden_size and model.num_layers must be > 0")
    _need(m.intermediate_size > 0, f"model.intermediate_size must be > 0, got {m.intermediate_size}")
    _need(m.num_heads > 0, f"model.num_heads must be > 0, got {m.num_heads}")
    _need(m.num_kv_heads > 0, f"model.num_kv_heads must be > 0, got {m.num_kv_heads}")
    _need(m.num_heads % m.num_kv_heads == 0,
          f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads ({m.num_kv_heads})")
    _need(m.head_dim is None or m.head_dim > 0, f"model.head_dim must be > 0 or null, got {m.head_dim}")
    _need(m.head_dim is not None or m.hidden_size % m.num_heads == 0,
          f"model.hidden_size ({m.hidden_size}) not divisible by model.num_heads ({m.num_heads}); set model.head_dim")
    _need(m.dim_per_head % 2 == 0, f"head dim ({m.dim_per_head}) must be even for RoPE")
    _need(m.max_seq_len > 0, f"model.max_seq_len must be > 0, got {m.max_seq_len}")
    _need(m.qk_norm in ("full", "head", "none"), f"model.qk_norm must be full|head|none, got {m.qk_norm!r}")
    _need(m.num_experts >= 0, "model.num_experts must be >= 0")
    if m.is_moe:
        _need(1 <= m.top_k <= m.num_experts,
              f"model.top_k ({m.top_k}) must be between 1 and model.num_experts ({m.num_experts})")
    _need(m.lb_loss_coef >= 0 and m.z_loss_coef >= 0 and m.lm_head_z_loss_coef >= 0,
          "model.lb_loss_coef, model.z_loss_coef and model.lm_head_z_loss_coef must be >= 0")
    _need(m.z_loss_reduction in ("sum", "mean"), f"model.z_loss_reduction must be sum|mean, got {m.z_loss_reduction!r}")
    _need(m.loss_impl in LOSS_IMPLS, f"model.loss_impl must be one of {'|'.join(LOSS_IMPLS)}, got {m.loss_impl!r}")
    _need(m.loss_chunk_tokens >= 1, f"model.loss_chunk_tokens must be >= 1, got {m.loss_chunk_tokens}")
    _need(m.experts_impl in EXPERTS_IMPLS, f"model.experts_impl must be one of {EXPERTS_IMPLS}, got {m.experts_impl!r}")


def _check_seq(value: int, key: str, max_seq_len: int) -> None:
    _need(value > 0, f"{key} must be > 0, got {value}")
    _need(value <= max_seq_len, f"{key} ({value}) exceeds model.max_seq_len ({max_seq_len})")


def _check_training(p: Params) -> None:
    m, s = p.model, p.spes
    _need(s.method in METHODS, f"spes.method must be one of {METHODS}, got {s.method!r}")
    _need(s.num_nodes >= 1, "spes.num_nodes must be >= 1")
    if s.method == "spes":
        _need(m.is_moe, "spes.method=spes needs an MoE model (model.num_experts > 0)")
        try:  # the same function the nodes use to find their experts
            Ownership.plan(m.num_experts, s.num_nodes, s.ownership)
        except OwnershipError as e:
            key = "spes.ownership" if s.ownership is not None else "model.num_experts / spes.num_nodes"
            raise ConfigError(f"{key}: {e}") from None
    elif s.ownership is not None:
        raise ConfigError(f"spes.ownership is only used by spes.method=spes (got method {s.method!r})")
    _need(s.sync_steps >= 1, "spes.sync_steps must be >= 1")
    _need(s.rounds >= 1, f"spes.rounds must be >= 1, got {s.rounds}")
    _need(0 <= s.warmup_rounds <= s.rounds, f"spes.warmup_rounds ({s.warmup_rounds}) must be in [0, spes.rounds={s.rounds}]")
    _need(s.batch_size >= 1, f"spes.batch_size must be >= 1, got {s.batch_size}")
    o = p.orchestration
    _need(o.heartbeat_timeout_s > 0, f"orchestration.heartbeat_timeout_s must be > 0, got {o.heartbeat_timeout_s}")
    for key, value in (("node_deployment", o.node_deployment), ("spare_deployment", o.spare_deployment)):
        if value is None and key == "spare_deployment":
            continue
        ok = isinstance(value, str) and DEPLOYMENT_NAME.fullmatch(value.replace("{node}", "0")) is not None
        _need(ok and value.count("{") == value.count("{node}"),
              f"orchestration.{key} must be '<flow>/<deployment>' (optionally with {{node}}), got {value!r}")
    ranks = p.orchestration.gpus_per_node
    _need(ranks >= 1, f"orchestration.gpus_per_node must be >= 1, got {ranks}")
    _need(s.batch_size % ranks == 0,
          f"spes.batch_size ({s.batch_size}) must be a multiple of orchestration.gpus_per_node ({ranks})")
    _need(s.node_parallel in NODE_PARALLEL, f"spes.node_parallel must be one of {'|'.join(NODE_PARALLEL)}, "
                                            f"got {s.node_parallel!r}")
    _need(s.node_parallel != "fsdp" or ranks > 1,
          "spes.node_parallel is fsdp, which shards a node over its ranks, but orchestration.gpus_per_node is 1 "
          "(use ddp, or 2 or more GPUs per node)")
    mb = s.micro_batch_size
    _need(mb is None or (mb >= 1 and (s.batch_size // ranks) % mb == 0),
          f"spes.micro_batch_size ({mb}) must divide the per-rank batch (spes.batch_size / "
          f"orchestration.gpus_per_node = {s.batch_size // ranks})")
    _need(s.activation_checkpointing in ("none", "block"),
          f"spes.activation_checkpointing must be none|block, got {s.activation_checkpointing!r}")
    _check_seq(s.seq_len, "spes.seq_len", m.max_seq_len)
    _check_optim(s.optim, "spes.optim")
    _need(s.frozen_dtype in ("float32", "bfloat16"), f"spes.frozen_dtype must be float32|bfloat16, got {s.frozen_dtype!r}")
    _need(s.autocast in (None, "bfloat16", "float16"), f"spes.autocast must be null|bfloat16|float16, got {s.autocast!r}")
    _need(s.outer_lr > 0, f"spes.outer_lr must be > 0, got {s.outer_lr}")
    _need(0.0 <= s.outer_momentum < 1.0, f"spes.outer_momentum must be in [0, 1), got {s.outer_momentum}")
    _need(0.0 <= s.outer_beta2 < 1.0, f"spes.outer_beta2 must be in [0, 1), got {s.outer_beta2}")
    _need(s.outer_eps > 0, f"spes.outer_eps must be > 0, got {s.outer_eps}")
    _need(s.shared_outer in ("average", "nesterov"),
          f"spes.shared_outer must be average|nesterov, got {s.shared_outer!r}")
    _need(s.shared_outer == "average" or s.method == "spes",
          f"spes.shared_outer: nesterov is for spes.method spes (diloco always takes its outer step; "
          f"{s.method} averages), got method {s.method!r}")
    mg = s.merge
    _need(mg.interval >= 1 and mg.decay_steps >= 1 and mg.top_k >= 1, "spes.merge.interval/decay_steps/top_k must be >= 1")
    _need(0.0 <= mg.alpha_start <= 1.0, f"spes.merge.alpha_start must be in [0, 1], got {mg.alpha_start}")
    if m.is_moe and mg.enabled:
        _need(mg.top_k < m.num_experts, f"spes.merge.top_k ({mg.top_k}) must be < model.num_experts ({m.num_experts})")


def _check_stages(p: Params) -> None:
    d, e, t = p.dense, p.eval, p.tokenize
    _need(d.steps >= 1, f"dense.steps must be >= 1, got {d.steps}")
    _need(d.batch_size >= 1, f"dense.batch_size must be >= 1, got {d.batch_size}")
    _check_seq(d.seq_len, "dense.seq_len", p.model.max_seq_len)
    _check_optim(d.optim, "dense.optim")
    _need(d.export_arch in ("auto", "qwen3", "llama"), f"dense.export_arch must be auto|qwen3|llama, got {d.export_arch!r}")
    _need((e.batches is None or e.batches >= 1) and e.batch_size >= 1, "eval.batches (or null) and eval.batch_size must be >= 1")
    _need(e.every_rounds >= 0 and e.round_batches >= 1, "eval.every_rounds must be >= 0 and eval.round_batches >= 1")
    _need(e.round_windows in ("spread", "first"), f"eval.round_windows must be spread|first, got {e.round_windows!r}")
    _check_seq(e.seq_len, "eval.seq_len", p.model.max_seq_len)
    _need(p.init.mode in ("scratch", "upcycle"), f"init.mode must be scratch|upcycle, got {p.init.mode!r}")
    _need(0.0 <= p.init.noise_fraction <= 1.0, "init.noise_fraction must be in [0, 1]")
    _need(p.init.noise_std >= 0 and p.init.router_init_std >= 0, "init.noise_std and init.router_init_std must be >= 0")
    _need(t.corpus_format in ("auto", "text", "json", "parquet"),
          f"tokenize.corpus_format must be auto|text|json|parquet, got {t.corpus_format!r}")
    _need(not (t.corpus and t.dataset), "tokenize.corpus and tokenize.dataset are exclusive: name one source")
    _need(bool(t.text_field), "tokenize.text_field must not be empty")
    _need(0.0 < t.val_fraction < 0.5, "tokenize.val_fraction must be in (0, 0.5)")
    _need(t.max_files >= 1, f"tokenize.max_files must be >= 1, got {t.max_files}")
    _need(t.bpe_sample_docs >= 1, f"tokenize.bpe_sample_docs must be >= 1, got {t.bpe_sample_docs}")
    _need(t.shard_tokens >= 1024, f"tokenize.shard_tokens must be >= 1024, got {t.shard_tokens}")
    _need(p.data.order in DATA_ORDERS, f"data.order must be one of {'|'.join(DATA_ORDERS)}, got {p.data.order!r}")


def _check_orchestration(p: Params) -> None:
    o, s = p.orchestration, p.spes
    check_name(o.run_name, "orchestration.run_name")
    mn = o.min_nodes
    _need(mn is None or 1 <= mn <= s.num_nodes, f"orchestration.min_nodes ({mn}) must be in [1, spes.num_nodes={s.num_nodes}]")
    planned_changes(o.membership_plan, s.rounds, s.num_nodes)  # raises OwnershipError (a ConfigError) naming the entry
    _need(o.evict_after_rounds >= 0, f"orchestration.evict_after_rounds must be >= 0, got {o.evict_after_rounds}")
    _need(o.evict_after_rounds == 0 or (mn is not None and mn < s.num_nodes),
          "orchestration.evict_after_rounds needs orchestration.min_nodes below spes.num_nodes: with a quorum of "
          "every member, a round a node misses fails before the node can be evicted")
    _need(bool(DEVICE_PATTERN.fullmatch(o.device)), f"orchestration.device must be auto|cpu|cuda|cuda:K, got {o.device!r}")
    _need(o.executor in ("process", "deployment"), f"orchestration.executor must be process|deployment, got {o.executor!r}")
    _need(o.threads_per_node is None or o.threads_per_node >= 1,
          f"orchestration.threads_per_node must be >= 1 or null, got {o.threads_per_node}")
    _need(o.log_every_steps >= 0, f"orchestration.log_every_steps must be >= 0, got {o.log_every_steps}")
    _need(o.node_retries >= 0, f"orchestration.node_retries must be >= 0, got {o.node_retries}")
    _need(o.round_timeout_s > 0, f"orchestration.round_timeout_s must be > 0, got {o.round_timeout_s}")
    _need(o.lock_ttl_s >= 3, f"orchestration.lock_ttl_s must be >= 3 seconds (refreshed every ttl/3), got {o.lock_ttl_s}")
    _need(bool(p.storage.url), "storage.url must not be empty")
    _need(p.storage.timeout_s > 0, f"storage.timeout_s must be > 0, got {p.storage.timeout_s}")
    _need(p.storage.retries >= 0, f"storage.retries must be >= 0, got {p.storage.retries}")
    ks = p.storage.keep_superseded
    _need(ks is None or ks >= 1, f"storage.keep_superseded must be >= 1 or null, got {ks}")
    k = p.storage.keep_rounds
    _need(k is None or k >= 1, f"storage.keep_rounds must be >= 1 or null, got {k}")
    _need(p.checkpoint.every_rounds >= 1, f"checkpoint.every_rounds must be >= 1, got {p.checkpoint.every_rounds}")
    kl = p.checkpoint.keep_last
    _need(kl is None or kl >= 1, f"checkpoint.keep_last must be >= 1 or null, got {kl}")
    _need(p.sync.codec in CODECS, f"sync.codec must be one of {'|'.join(CODECS)}, got {p.sync.codec!r}")
    _need(p.sync.int8_block >= 1, f"sync.int8_block must be >= 1, got {p.sync.int8_block}")


def _check_numbers(p: Params) -> None:
    """Every number finite (YAML reads 1e309 as inf), every seed >= 0 (numpy refuses negative seeds)."""
    for key, value in flatten(to_dict(p)).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    for key in ("spes.seed", "tokenize.seed", "init.seed", "dense.seed"):
        section, leaf = key.split(".")
        value = getattr(getattr(p, section), leaf)
        _need(value >= 0, f"{key} must be >= 0, got {value}")
    m = p.model
    _need(m.rope_theta > 0, f"model.rope_theta must be > 0, got {m.rope_theta}")
    _need(m.rms_norm_eps >= 0, f"model.rms_norm_eps must be >= 0, got {m.rms_norm_eps}")
    _need(m.init_std >= 0, f"model.init_std must be >= 0, got {m.init_std}")


STORAGE_PROTOCOLS = ("file", "s3")
"""Where a run can live: the commit protocol needs whole writes and exclusive creates (local files, S3)."""


def _check_storage_url(url: str) -> None:
    proto, sep, rest = url.partition("://")
    if not sep:
        return  # a local path
    _need(proto in STORAGE_PROTOCOLS, f"storage.url {url!r}: protocol {proto!r} is not supported (a local path, "
                                      "file:// or s3://bucket/prefix)")
    if proto == "s3":
        _need(bool(rest.split("/", 1)[0]), f"storage.url {url!r} names no bucket (s3://bucket/prefix)")


def validate(p: Params) -> Params:
    """Cross-field checks; raises ConfigError naming the key."""
    _check_numbers(p)
    _check_storage_url(p.storage.url)
    _check_model(p)
    _check_training(p)
    _check_stages(p)
    _check_orchestration(p)
    return p


def _to_params(*configs: Any, where: str = "") -> Params:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Params), *configs)
        params: Params = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{where}{str(e).splitlines()[0]} (key: {key}){_did_you_mean(key)}") from None
    return validate(params)


def _did_you_mean(key: str) -> str:
    """'; did you mean spes.num_nodes?' for a key that is not in the schema but close to one that is."""
    import difflib

    known = [k for k in flatten(to_dict(Params())) if not k.startswith("compare.variants")]
    if key in known:
        return ""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def load_params(path: str = "params.yaml", overrides: Optional[list[str]] = None) -> Params:
    """Read `path` onto the schema, apply `key=value` overrides, validate. One error line on failure."""
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides or []))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:  # a value YAML cannot parse: one line
        raise ConfigError(f"bad override in {overrides}: {type(e).__name__}: "
                          f"{(getattr(e, 'problem', None) or str(e)).splitlines()[0]}") from None
    return _to_params(*_load_with_includes(path, ()), dotlist, where=f"{path}: ")


def _load_with_includes(path: str, seen: tuple[str, ...]) -> list:
    """The YAML at `path`, preceded by what its `include:` names (a file relative to it, itself possibly
    including another): presets under configs/ change a few keys of params.yaml this way."""
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"{path}: include cycle ({' -> '.join(seen + (real,))})")
    if not os.path.exists(path):
        raise ConfigError(f"params file not found: {path}" + (f" (included by {seen[-1]})" if seen else ""))
    try:
        loaded = OmegaConf.load(path)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text (UTF-8) YAML file") from None
    except yaml.YAMLError as e:  # e.g. a duplicate key (two variants of one name): never silently the last
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: {getattr(e, 'problem', None) or e}{where}") from None
    include = loaded.pop("include", None) if isinstance(loaded, DictConfig) else None
    if include is None:
        return [loaded]
    if not isinstance(include, str):
        raise ConfigError(f"{path}: include must be one file name, got {include!r}")
    below = _load_with_includes(os.path.join(os.path.dirname(path), include), seen + (real,))
    for key, dropped in REPLACED.items():  # named sets, not merged: the including file's variants are the variants
        if OmegaConf.select(loaded, key) is None:
            continue
        for gone in dropped:
            parent, _, leaf = gone.rpartition(".")
            for cfg in below:
                node = OmegaConf.select(cfg, parent)
                if isinstance(node, DictConfig) and leaf in node:
                    node.pop(leaf)
    return below + [loaded]


def params_from_dict(d: dict) -> Params:
    """A resolved params dict (what the flow hands to nodes) back into validated Params."""
    return _to_params(OmegaConf.create(d))


def to_dict(obj: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(obj), resolve=True)  # type: ignore[return-value]


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def overrides_between(base: Params, other: Params, written: Optional[set[str]] = None) -> list[str]:
    """`key=value` for every setting in which `other` differs from `base` (what `dvc exp run -S` takes);
    `+key=value` for those not written in the base file (`written`: its keys), which DVC must add, not set."""
    a, b = flatten(to_dict(base)), flatten(to_dict(other))
    return [f"{'+' if written is not None and k not in written else ''}{k}="
            f"{yaml.safe_dump(b[k], default_flow_style=True).strip().removesuffix('...').strip()}"
            for k in sorted(b) if a.get(k) != b[k]]


def written_keys(path: str) -> set[str]:
    """The dotted keys a params file writes itself (its includes aside)."""
    return set(flatten(OmegaConf.to_container(_load_with_includes(path, ())[-1])))


def main() -> None:
    import argparse
    import shlex

    ap = argparse.ArgumentParser(description="Validate a params file; with --set-params print the `dvc exp run` "
                                 "flags that turn params.yaml into it: dvc exp run $(python -m spes.config "
                                 "configs/spes-1b.yaml --set-params)")
    ap.add_argument("path")
    ap.add_argument("--set-params", action="store_true")
    ap.add_argument("--base", default="params.yaml")
    a = ap.parse_args()
    try:
        p = load_params(a.path)
        flags = overrides_between(load_params(a.base), p, written_keys(a.base)) if a.set_params else None
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    print(" ".join(f"-S {shlex.quote(o)}" for o in flags) if flags is not None else f"{a.path}: valid")


if __name__ == "__main__":
    main()
