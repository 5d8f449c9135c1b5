"""Shared bits of the DVC entry points: argument parsing, params, output folders, Prefect env defaults."""
from __future__ import annotations

import argparse
import json
import os
import sys

from spes.config.loader import load_params
from spes.config.schema import Params
from spes.errors import ConfigError


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
    """Quiet, local Prefect defaults for the stages (no analytics; INFO logs)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")


def run(main) -> None:
    """Run a stage's main: the errors that describe bad input end the stage with one line on stderr
    (exit 1), not a traceback."""
    from spes.errors import CorpusError, DataError, DeviceError, HFConversionError, StorageError, UpcycleError

    name = os.path.basename(sys.argv[0]).removesuffix(".py") if sys.argv and sys.argv[0] else "stage"
    try:
        main()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except (DataError, DeviceError, HFConversionError, StorageError, CorpusError, UpcycleError) as e:
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1)
