"""A run's identity: the fingerprint of the settings that define its maths, and its initial model.

The fingerprint hashes the fully resolved sections model, init, sync, train, outer, merge, tokenize, data and
dense, every key, defaults included: changing a default in the schema changes the fingerprint of every run
that relied on it, so no run resumes across a change of its maths. It hashes each key under the name it had
when fingerprints began (spes/config/renamed.py: `train.optim.lr` is hashed as `spes.optim.lr`), so the split of
the former `spes` section changed no fingerprint: runs made before it resume bitwise. The lists below name
keys as they are now. Two of them keep the fingerprint honest over releases:

- NOT_IN_FINGERPRINT: implementation choices that leave the maths alone (like the device and storage);
- ADDED_LATER: keys added after runs existed, with the value that reproduces the old behaviour; a key at
  that value is left out, so runs made before it existed keep their fingerprint and stay resumable.

Runs made before fingerprints had a version (their info has no `fingerprint_version`) hashed only the
values that differed from the schema defaults of that time; `legacy_fingerprint` recomputes that hash with
those defaults, so such runs stay resumable too.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from spes.config.loader import flatten, to_dict
from spes.config.renamed import SPLIT_SECTIONS, former_name
from spes.config.schema import ModelConfig, Params
from spes.errors import IntegrityError, ProtocolError
from spes.model.names import canonical_shapes
from spes.storage.tensorio import tensors_sha256

FINGERPRINT_VERSION = 2
FINGERPRINT_SECTIONS = ("model", "init", *SPLIT_SECTIONS, "tokenize", "data", "dense")
FORMER_SECTIONS = ("model", "init", "spes", "sync", "tokenize", "data", "dense")
"""The same settings as sections were named before the split (legacy_fingerprint hashes them so)."""
NOT_IN_FINGERPRINT = {"model.experts_impl", "model.loss_impl", "model.loss_chunk_tokens", "train.node_parallel"}
"""Implementation choices that leave the maths alone."""
ADDED_LATER: dict[str, Any] = {"train.optim.schedule": "cosine", "train.optim.decay_fraction": 0.2,
                               "dense.optim.schedule": "cosine", "dense.optim.decay_fraction": 0.2,
                               "outer.shared": "average", "sync.average_optimizer_state": False,
                               "outer.beta2": 0.99, "outer.eps": 1e-3, "sync.overlap": "none",
                               "sync.max_delta_norm_ratio": None, "outer.experts": "owner"}
"""Keys added after fingerprint version 2, each with its neutral value (the behaviour before it existed)."""
LEGACY_DEFAULTS = {"model.norm_topk_prob": False, "model.qk_norm": "full", "merge.interval": 40,
                   "sync.every_steps": 20, "sync.warmup_rounds": 5, "sync.rounds": 12, "train.optim.lr": 3e-3,
                   "train.optim.warmup_steps": 20}
"""Schema defaults (in the fingerprinted sections) before they were made equal to params.yaml's values."""


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _sections(settings: dict) -> dict[str, Any]:
    """The fingerprinted sections of `settings` (as `to_dict` gives them), flattened, without NOT_IN_FINGERPRINT."""
    flat = flatten({s: settings.get(s, {}) for s in FINGERPRINT_SECTIONS})
    return {k: v for k, v in flat.items() if k not in NOT_IN_FINGERPRINT}


def fingerprinted(settings: dict) -> dict[str, Any]:
    """The flattened settings the fingerprint hashes, under their former names. With the wsd schedule (and no
    decayed load-balance factor, whose ramp is a share of the total) sync.rounds only moves the decay: an
    extended run is the same run, whose rounds past the shorter stable phase are recomputed
    (spes/round/driver.py: resume_point)."""
    flat = {k: v for k, v in _sections(settings).items() if not (k in ADDED_LATER and v == ADDED_LATER[k])}
    if flat.get("train.optim.schedule") == "wsd" and not flat.get("train.decayed_lb"):
        flat.pop("sync.rounds", None)
    return {former_name(k): v for k, v in flat.items()}


def fingerprint_of(settings: dict) -> str:
    """Hash of the fully resolved settings that define the maths (see the module docstring)."""
    return _hash({"version": FINGERPRINT_VERSION, "settings": fingerprinted(settings)})


def settings_fingerprint(p: Params) -> str:
    return fingerprint_of(to_dict(p))


def _non_default(d: Any, default: Any) -> Any:
    if isinstance(d, dict) and isinstance(default, dict):
        out = {k: _non_default(v, default.get(k)) for k, v in d.items() if k not in default or v != default[k]}
        return {k: v for k, v in out.items() if v != {} or k not in default}
    return d


def legacy_fingerprint(p: Params) -> str:
    """The fingerprint a run made before fingerprint versions recorded for these settings."""
    defaults = _former_nested({**_sections(to_dict(Params())), **LEGACY_DEFAULTS})
    settings = _former_nested(_sections(to_dict(p)))
    return _hash({k: _non_default(settings.get(k, {}), defaults[k]) for k in FORMER_SECTIONS})


def _former_nested(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat settings under their current names -> nested sections under their former names."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = former_name(key).split(".")
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return out


@dataclass
class InitModel:
    """Round 0 of a run: canonical tensors, the model config they belong to, where they came from."""

    tensors: dict[str, torch.Tensor]
    model_config: dict
    source: str

    @property
    def sha256(self) -> str:
        """The sha256 of round 0's model file once committed (bundles write tensors sorted by name)."""
        return tensors_sha256(self.tensors)

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> "InitModel":
        return cls({k: v.detach().cpu() for k, v in tensors.items()}, dataclasses.asdict(cfg), source)

    @staticmethod
    def config_of(path: str) -> dict:
        """The `config.json` beside the initial model `path` (its model config checked against the schema),
        read without the tensors: what a check of the settings against the model needs."""
        cfg_path = os.path.join(os.path.dirname(path), "config.json")
        for f in (path, cfg_path):
            if not os.path.exists(f):
                raise ProtocolError(f"initial model: {f} does not exist; run the upcycle stage first "
                                    "(dvc repro upcycle)")
        try:
            with open(cfg_path) as fh:
                cfg = json.load(fh)
            ModelConfig(**cfg["model_config"])
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"{cfg_path}: not an initial model's config ({type(e).__name__}: {e})") from None
        return cfg

    @classmethod
    def load(cls, path: str) -> "InitModel":
        """The `upcycle` stage's output: `model.safetensors` + `config.json` beside it (checked to match)."""
        cfg = cls.config_of(path)
        model_config = ModelConfig(**cfg["model_config"])
        try:
            tensors = load_file(path)
        except Exception as e:  # not a safetensors file
            raise IntegrityError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from None
        want = canonical_shapes(model_config)
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != want:
            bad = sorted(set(got.items()) ^ set(want.items()))[:3]
            raise IntegrityError(f"init model {path} does not match its config.json (e.g. {bad})")
        return cls(tensors, cfg["model_config"], cfg.get("source", "init"))
