"""Settings naming a folder on this machine: checked before anything is written, one line naming the key."""
import os

import pytest

from spes.config.local_paths import check_local_paths, local_path_settings
from spes.config.schema import Params
from spes.errors import ConfigError


def test_every_local_folder_setting_is_checked_where_it_is_used(tmp_path):
    p = Params()
    p.artifacts_dir, p.storage.url = str(tmp_path / "a"), "s3://bucket/runs"
    keys = dict(local_path_settings(p))
    assert keys == {"artifacts_dir": str(tmp_path / "a"), "orchestration.tensorboard_dir": str(tmp_path / "a/tensorboard"),
                    "orchestration.node_cache_dir": "~/.cache/spes"}
    p.storage.url = f"file://{tmp_path}/s"  # nodes on other machines: their folders are theirs to check
    assert dict(local_path_settings(p, nodes_here=False))["storage.url"] == f"{tmp_path}/s" and \
        "orchestration.node_cache_dir" not in dict(local_path_settings(p, nodes_here=False))
    check_local_paths(p, nodes_here=False)
    assert os.listdir(tmp_path) == []  # nothing left behind by the check


@pytest.mark.parametrize("key,value,message", [
    ("artifacts_dir", "{f}", "artifacts_dir: {f} is a file, not a folder"),
    ("tensorboard_dir", "{f}/tb", "orchestration.tensorboard_dir: {f}/tb cannot be made: {f} is a file"),
    ("tensorboard_dir", "/proc/x", "orchestration.tensorboard_dir: /proc/x cannot be written"),
    ("node_state_dir", "{f}", "orchestration.node_state_dir: {f} is a file"),
])
def test_a_file_or_a_folder_that_cannot_be_made_is_one_line_naming_the_key(tmp_path, key, value, message):
    f = tmp_path / "a-file"
    f.write_text("x")
    p = Params()
    p.artifacts_dir, p.storage.url = str(tmp_path / "art"), str(tmp_path / "storage")
    target = p if key == "artifacts_dir" else p.orchestration
    setattr(target, key, value.format(f=f))
    with pytest.raises(ConfigError, match="^" + message.format(f=f).replace("/", r"\/")):
        check_local_paths(p)
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
