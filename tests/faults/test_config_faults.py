"""Settings that used to be accepted and break later (or fail with a traceback): each is one line naming the
key, before any compute or write (issue 18, item 4 and 5)."""
import pytest
import yaml

from spes.config.loader import load_params
from spes.config.schema import check_name
from spes.errors import ConfigError
from tests.conftest import ROOT

PARAMS = f"{ROOT}/params.yaml"


@pytest.mark.parametrize("override,message", [
    ("train.optim.lr=inf", "train.optim.lr must be a finite number, got inf"),
    ("train.optim.lr=1e309", "train.optim.lr must be a finite number, got inf"),
    ("train.seed=-1", "train.seed must be >= 0, got -1"),
    ("model.rope_theta=0", "model.rope_theta must be > 0"),
    ("model.rope_theta=nan", "model.rope_theta must be a finite number, got nan"),
    ("model.rms_norm_eps=-1", "model.rms_norm_eps must be >= 0"),
    ("model.init_std=-0.1", "model.init_std must be >= 0"),
    ("tokenize.seed=-1", "tokenize.seed must be >= 0"),
    ("storage.url=ftp://host/x", "protocol 'ftp' is not supported"),
    ("storage.url=nosuchproto://x", "protocol 'nosuchproto' is not supported"),
    ("storage.url=s3://", "names no bucket"),
    ("train.optim.lr=[1,", "bad override in .*ParserError"),
])
def test_a_bad_setting_is_one_line_naming_it(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_params(PARAMS, [override])
    assert len(str(e.value).splitlines()) == 1


def test_a_params_file_of_binary_bytes(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="not a text .*YAML file"):
        load_params(str(f))


@pytest.mark.parametrize("name", ["evil\n", "evil\r", "a/b", "..", ".hidden", "x" * 129])
def test_names_that_become_paths_match_whole(tmp_path, name):
    with pytest.raises(ConfigError, match="not a safe name"):
        check_name(name, "orchestration.run_name")
    d = yaml.safe_load(open(PARAMS))
    d["orchestration"]["run_name"] = name
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="orchestration.run_name: .* is not a safe name"):
        load_params(str(f))


@pytest.mark.parametrize("override,suggestion", [("spes.num_node=3", "sync.num_nodes"),
                                                 ("merge.intervall=3", "merge.interval")])
def test_a_typo_in_a_key_suggests_the_closest_key(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}\\?"):
        load_params(PARAMS, [override])
