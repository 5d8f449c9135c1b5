"""Shared bits of the DVC entry points: argument parsing, params, output folders, Prefect env defaults."""
from __future__ import annotations

import argparse
import json
import os
import sys

from spes.config import ConfigError, Params
from spes.params import load_params


def parse(description: str) -> tuple[argparse.Namespace, Params]:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of params.yaml")
    a = ap.parse_args()
    try:
        return a, load_params(a.params, a.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)


def out_dir(p: Params, name: str) -> str:
    d = os.path.join(p.artifacts_dir, name)
    os.makedirs(d, exist_ok=True)
    return d


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def prefect_env_defaults() -> None:
    """Ephemeral Prefect (no PREFECT_API_URL) needs more than the default 20 s to start on small machines."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
