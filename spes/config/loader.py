"""Reading `params.yaml` onto the schema.

`load_params` merges the YAML (after the file it `include`s, if any: the presets under configs/) and
`key=value` overrides onto the schema in `spes/config/schema.py`, so unknown keys and wrong types fail at
load time, and builds the `Params`, whose own checks (beside the fields, spes/config/schema.py) give one-line
errors naming the key, before any compute or any write to storage. It reads no files besides the params file
itself (deployment nodes re-validate and hold no corpus).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spes.config.renamed import SPLIT_SECTIONS, former_name, new_name
from spes.config.schema import Params
from spes.errors import ConfigError

REPLACED = {"compare.variants": ("compare.variants", "compare.pairs"), "compare.pairs": ("compare.pairs",)}
"""Settings an including file replaces whole instead of merging into, and what each replaces: the pairs name
variants, so new variants drop the included pairs as well (see _load_with_includes)."""


def validate(p: Params) -> Params:
    """Every check of every section and across them (Params.validate); raises ConfigError naming the key.
    A Params is validated when built: this is for one changed afterwards."""
    return p.validate()


def _to_params(*configs: Any, where: str = "", overrides: Optional[list[str]] = None) -> Params:
    """The merged configs as Params. An error names where the bad key came from: `where` (the params file), or
    the command line's `key=value` when the key was given there."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Params), *configs)
        params: Params = OmegaConf.to_object(merged)  # type: ignore[assignment]  # checked as it is built
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        given = [o for o in overrides or [] if o.split("=", 1)[0].lstrip("+") == key]
        origin = f"command line {given[-1]!r}: " if given else where
        raise ConfigError(f"{origin}{str(e).splitlines()[0]} (key: {key}){_did_you_mean(key)}") from None
    return params


def _did_you_mean(key: str, spelled=lambda k: k) -> str:
    """'; did you mean sync.num_nodes?' for a key that is not in the schema but close to one that is, as
    `spelled` writes the schema's keys (a former key is set against the keys' former names)."""
    import difflib

    known = {spelled(k): k for k in flatten(to_dict(Params())) if not k.startswith("compare.variants")}
    if key in known:
        return ""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return f"; did you mean {known[close[0]]}?" if close else ""


def load_params(path: str = "params.yaml", overrides: Optional[list[str]] = None) -> Params:
    """Read `path` onto the schema, apply `key=value` overrides, validate. One error line on failure."""
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides or []))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:  # a value YAML cannot parse: one line
        raise ConfigError(f"bad override in {overrides}: {type(e).__name__}: "
                          f"{(getattr(e, 'problem', None) or str(e)).splitlines()[0]}") from None
    configs = _load_with_includes(path, ())
    for cfg in configs:
        _refuse_former_keys(cfg, f"{path}: ")
    _refuse_former_keys(dotlist, "override: ")
    return _to_params(*configs, dotlist, where=f"{path}: ", overrides=list(overrides or []))


def _refuse_former_keys(cfg: Any, where: str) -> None:
    """One line naming the new key of a setting of the former `spes` section (spes/config/renamed.py)."""
    if not isinstance(cfg, DictConfig) or "spes" not in cfg:
        return
    spes = OmegaConf.to_container(cfg["spes"]) if isinstance(cfg["spes"], DictConfig) else None
    for key in flatten(spes, "spes.") if spes else ["spes"]:
        new = new_name(key)
        if new is not None:
            raise ConfigError(f"{where}{key} is now {new} (the spes section was split into "
                              f"{', '.join(SPLIT_SECTIONS)})")
    key = next(iter(flatten(spes, "spes."))) if spes else "spes"
    raise ConfigError(f"{where}the spes section was split into {', '.join(SPLIT_SECTIONS)}; "
                      f"{key} is not a setting of any of them{_did_you_mean(key, former_name)}")


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
    cfg = OmegaConf.create(d)
    _refuse_former_keys(cfg, "")
    return _to_params(cfg)


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
    p = load_params(a.path)  # a ConfigError ends the command in one line (spes.cli)
    flags = overrides_between(load_params(a.base), p, written_keys(a.base)) if a.set_params else None
    print(" ".join(f"-S {shlex.quote(o)}" for o in flags) if flags is not None else f"{a.path}: valid")


if __name__ == "__main__":
    from spes.cli import run_command

    run_command(main)
