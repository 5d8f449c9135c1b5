"""Validation: every bad setting is a one-line ConfigError naming its key, before any compute."""
import os

import pytest

from spes.config import ConfigError, Params
from spes.params import check_name, load_params, params_from_dict, to_dict, validate

PARAMS_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "params.yaml")


def test_the_embedded_default_validates_and_round_trips():
    p = load_params(PARAMS_YAML)
    assert params_from_dict(to_dict(p)) == p


@pytest.mark.parametrize("override,key", [
    ("spes.num_nodes=3", "model.num_experts / spes.num_nodes"),
    ("model.top_k=9", "model.top_k"),
    ("spes.method=gossip", "spes.method"),
    ("orchestration.min_nodes=5", "orchestration.min_nodes"),
    ("spes.optim.lr=-1", "spes.optim.lr"),
    ("spes.optim.lr=0", "spes.optim.lr"),
    ("dense.optim.lr=0", "dense.optim.lr"),
    ("dense.batch_size=0", "dense.batch_size"),
    ("spes.batch_size=0", "spes.batch_size"),
    ("spes.ownership=[[0,1,2,3],[4,5,6,7],[]]", "spes.ownership"),
    ("spes.ownership=[[0,1,2],[3,4,5,6]]", "spes.ownership"),
    ("model.num_kv_heads=0", "model.num_kv_heads"),
    ("model.num_heads=0", "model.num_heads"),
    ("spes.seq_len=0", "spes.seq_len"),
    ("spes.seq_len=-4", "spes.seq_len"),
    ("eval.seq_len=1024", "eval.seq_len"),
    ("orchestration.round_timeout_s=0", "orchestration.round_timeout_s"),
    ("orchestration.lock_ttl_s=0", "orchestration.lock_ttl_s"),
    ("orchestration.lock_ttl_s=-5", "orchestration.lock_ttl_s"),
    ("orchestration.run_name=../../../x", "orchestration.run_name"),
    ("orchestration.run_name=a/b", "orchestration.run_name"),
    ("orchestration.device=gpu0", "orchestration.device"),
    ("spes.autocast=int8", "spes.autocast"),
    ("model.experts_impl=fast", "model.experts_impl"),
    ("storage.retries=-1", "storage.retries"),
    ("spes.rounds=0", "spes.rounds"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("/", r"\s*/\s*")) as e:
        load_params(PARAMS_YAML, [override])
    assert "\n" not in str(e.value)


def test_validate_reads_no_files():
    p = Params()
    p.tokenize.corpus = "/nonexistent/*.txt"  # the tokenize stage checks the corpus; nodes hold none
    assert validate(p) is p


def test_unknown_keys_and_wrong_types(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("spes:\n  nodes: 3\n")
    with pytest.raises(ConfigError, match="nodes"):
        load_params(str(f))
    f.write_text("model:\n  hidden_size: lots\n")
    with pytest.raises(ConfigError, match="hidden_size"):
        load_params(str(f))
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("name", ["default", "run-1.b_2", "A"])
def test_safe_names(name):
    assert check_name(name, "k") == name


@pytest.mark.parametrize("name", ["..", "../x", "a/b", ".hidden", "a..b", "", "x" * 200, "a b", "a\\b"])
def test_unsafe_names(name):
    with pytest.raises(ConfigError, match="not a safe name"):
        check_name(name, "k")
