"""Validation: every bad setting is a one-line ConfigError naming its key, before any compute."""
import glob
import os

import pytest

from spes.config.loader import flatten, load_params, overrides_between, params_from_dict, to_dict, validate
from spes.config.schema import Params, check_name
from spes.errors import ConfigError
from tests.conftest import ROOT

PARAMS_YAML = os.path.join(ROOT, "params.yaml")


def test_the_embedded_default_validates_and_round_trips():
    p = load_params(PARAMS_YAML)
    assert params_from_dict(to_dict(p)) == p


@pytest.mark.parametrize("override,key", [
    ("sync.num_nodes=3", "model.num_experts / sync.num_nodes"),
    ("model.top_k=9", "model.top_k"),
    ("sync.method=gossip", "sync.method"),
    ("outer.shared=adam", "outer.shared"),
    ("outer.shared=nesterov sync.method=fedavg", "outer.shared: nesterov is for sync.method spes"),
    ("outer.experts=adam", "outer.experts"),
    ("outer.experts=nesterov sync.method=diloco", "outer.experts: nesterov is for sync.method spes"),
    ("orchestration.min_nodes=5", "orchestration.min_nodes"),
    ("train.optim.lr=-1", "train.optim.lr"),
    ("train.optim.lr=0", "train.optim.lr"),
    ("dense.optim.lr=0", "dense.optim.lr"),
    ("dense.batch_size=0", "dense.batch_size"),
    ("train.batch_size=0", "train.batch_size"),
    ("sync.ownership=[[0,1,2,3],[4,5,6,7],[]]", "sync.ownership"),
    ("sync.ownership=[[0,1,2],[3,4,5,6]]", "sync.ownership"),
    ("model.num_kv_heads=0", "model.num_kv_heads"),
    ("model.num_heads=0", "model.num_heads"),
    ("train.seq_len=0", "train.seq_len"),
    ("train.seq_len=-4", "train.seq_len"),
    ("eval.seq_len=1024", "eval.seq_len"),
    ("orchestration.round_timeout_s=0", "orchestration.round_timeout_s"),
    ("orchestration.lock_ttl_s=0", "orchestration.lock_ttl_s"),
    ("orchestration.lock_ttl_s=-5", "orchestration.lock_ttl_s"),
    ("orchestration.run_name=../../../x", "orchestration.run_name"),
    ("orchestration.run_name=a/b", "orchestration.run_name"),
    ("orchestration.device=gpu0", "orchestration.device"),
    ("train.autocast=int8", "train.autocast"),
    ("model.experts_impl=fast", "model.experts_impl"),
    ("storage.retries=-1", "storage.retries"),
    ("sync.rounds=0", "sync.rounds"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("/", r"\s*/\s*")) as e:
        load_params(PARAMS_YAML, override.split())
    assert "\n" not in str(e.value)


def test_validate_reads_no_files():
    p = Params()
    p.tokenize.corpus = "/nonexistent/*.txt"  # the tokenize stage checks the corpus; nodes hold none
    assert validate(p) is p


def test_unknown_keys_and_wrong_types(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("sync:\n  nodes: 3\n")
    with pytest.raises(ConfigError, match="nodes"):
        load_params(str(f))
    f.write_text("model:\n  hidden_size: lots\n")
    with pytest.raises(ConfigError, match="hidden_size"):
        load_params(str(f))
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(str(tmp_path / "missing.yaml"))


def test_a_bad_key_given_on_the_command_line_names_the_command_line(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("sync:\n  every_steps: 3\n")
    with pytest.raises(ConfigError, match=r"^command line 'sync\.every_steps=abc': Value 'abc' .* \(key: sync.every_steps\)$"):
        load_params(str(f), ["sync.rounds=4", "sync.every_steps=abc"])
    with pytest.raises(ConfigError, match=r"^command line 'sync\.nodes=3': Key 'nodes' not in 'SyncConfig'"):
        load_params(str(f), ["sync.nodes=3"])
    f.write_text("sync:\n  every_steps: abc\n")  # the file's own bad value still names the file
    with pytest.raises(ConfigError, match=rf"^{f}: Value 'abc'"):
        load_params(str(f), ["sync.rounds=4"])


@pytest.mark.parametrize("where,former,now", [
    ("yaml", "spes:\n  sync_steps: 20\n", "spes.sync_steps is now sync.every_steps"),
    ("yaml", "spes:\n  merge: {top_k: 2}\n", "spes.merge.top_k is now merge.top_k"),
    ("yaml", "spes:\n  shared_outer: nesterov\n", "spes.shared_outer is now outer.shared"),
    ("override", "spes.optim.lr=0.01", "spes.optim.lr is now train.optim.lr"),
    ("override", "spes.nodes=3", "the spes section was split into sync, train, outer, merge; spes.nodes is not"),
    ("variant", "spes.method=fedavg", "compare.variants.v: spes.method is now sync.method"),
])
def test_a_former_spes_key_is_one_line_naming_its_new_key(tmp_path, where, former, now):
    """Params files and overrides written before the split fail at once, naming where the setting went."""
    f = tmp_path / "p.yaml"
    f.write_text(former if where == "yaml" else "")
    with pytest.raises(ConfigError) as e:
        if where == "variant":
            from spes.eval.compare import variant_params

            p = Params()
            p.compare.variants = {"v": [former]}
            variant_params(p, "v")
        else:
            load_params(str(f), [former] if where == "override" else [])
    assert now in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["default", "run-1.b_2", "A"])
def test_safe_names(name):
    assert check_name(name, "k") == name


@pytest.mark.parametrize("name", ["..", "../x", "a/b", ".hidden", "a..b", "", "x" * 200, "a b", "a\\b"])
def test_unsafe_names(name):
    with pytest.raises(ConfigError, match="not a safe name"):
        check_name(name, "k")


PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "spes-*.yaml")))


@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_presets_validate_and_become_dvc_overrides(preset):
    p = load_params(preset)
    base = load_params(os.path.join(ROOT, "params.yaml"))
    flags = overrides_between(base, p)
    assert flags and to_dict(load_params(os.path.join(ROOT, "params.yaml"), flags)) == to_dict(p)


def test_includes(tmp_path):
    (tmp_path / "base.yaml").write_text("sync: {num_nodes: 4}\nmodel: {num_experts: 8}\n")
    (tmp_path / "top.yaml").write_text("include: base.yaml\ntrain: {batch_size: 4}\n")
    p = load_params(str(tmp_path / "top.yaml"))
    assert (p.sync.num_nodes, p.train.batch_size) == (4, 4)
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_params(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("include: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"params file not found: .*missing.yaml \(included by"):
        load_params(str(tmp_path / "c.yaml"))


def test_the_schema_defaults_are_the_embedded_defaults():
    """One source of defaults: a unit test's Params() computes what `dvc repro` on params.yaml computes
    (compare.variants and compare.pairs aside: a dict default would be merged into, not replaced)."""
    schema, file = flatten(to_dict(Params())), flatten(to_dict(load_params(os.path.join(ROOT, "params.yaml"))))
    differ = {k: (schema.get(k), v) for k, v in file.items() if schema.get(k) != v
              and not k.startswith(("compare.variants", "compare.pairs"))}
    assert not differ


@pytest.mark.parametrize("preset", ["spes-1b", "spes-7b", "spes-9b-upcycle"])
def test_set_params_flags_turn_params_yaml_into_the_preset_as_dvc_applies_them(tmp_path, preset):
    """The README's `dvc exp run $(python -m spes.config configs/<preset>.yaml --set-params)`: keys params.yaml
    does not write come as `+key=` (DVC refuses to set a key that is not there), and DVC's own override code
    turns a copy of params.yaml into exactly the preset."""
    import shlex
    import shutil
    import subprocess
    import sys

    from dvc.utils.hydra import apply_overrides

    out = subprocess.run([sys.executable, "-m", "spes.config", f"configs/{preset}.yaml", "--set-params"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    flags = shlex.split(out)
    overrides = [flags[i + 1] for i in range(0, len(flags), 2) if flags[i] == "-S"]
    assert "+model.lm_head_z_loss_coef=1.0e-05" in overrides  # not written in params.yaml
    copy = tmp_path / "params.yaml"
    shutil.copy(os.path.join(ROOT, "params.yaml"), copy)
    apply_overrides(str(copy), overrides)
    assert to_dict(load_params(str(copy))) == to_dict(load_params(os.path.join(ROOT, "configs", f"{preset}.yaml")))
