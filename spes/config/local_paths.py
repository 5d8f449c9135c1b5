"""Settings that name a folder on this machine, checked before a stage writes anything: a setting naming a
file, or a folder that cannot be made (`/proc/x`, a read-only mount), is one `config error:` line naming the
key, not a traceback after the lease was taken and round 0 committed.

Settings are checked only where they are used: the node's cache and state folders name the node machines'
folders, so they are checked here only when this machine runs the nodes (the caller says: its executor
knows, pipelines/executors.py).
"""
from __future__ import annotations

import os
import tempfile

from spes.config.schema import Params
from spes.errors import ConfigError


def local_path_settings(p: Params, nodes_here: bool = True) -> list[tuple[str, str]]:
    """(key, folder) for each setting of `p` naming a folder on this machine (the nodes' too, `nodes_here`)."""
    o = p.orchestration
    out = [("artifacts_dir", p.artifacts_dir)]
    if o.tensorboard_dir is not None:
        tb = os.path.expanduser(o.tensorboard_dir)
        out.append(("orchestration.tensorboard_dir", tb if os.path.isabs(tb) else os.path.join(p.artifacts_dir, tb)))
    url = p.storage.url
    if "://" not in url or url.startswith("file://"):
        out.append(("storage.url", url.removeprefix("file://")))
    if nodes_here:
        out.append(("orchestration.node_cache_dir", o.node_cache_dir))
        if o.node_state_dir is not None:
            out.append(("orchestration.node_state_dir", o.node_state_dir))
    return out


def check_folder(key: str, folder: str) -> None:
    """`folder` is a folder, or one can be made there: its nearest existing parent is a folder this process can
    create entries in (tried with an empty folder, removed at once)."""
    path = os.path.abspath(os.path.expanduser(folder))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: {folder} is a file, not a folder")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}: {folder} cannot be made: {parent} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".spes-check-", dir=parent))
    except OSError as e:
        raise ConfigError(f"{key}: {folder} cannot be written ({e.strerror or e} in {parent})") from None


def check_local_paths(p: Params, nodes_here: bool = True) -> None:
    for key, folder in local_path_settings(p, nodes_here):
        check_folder(key, folder)
