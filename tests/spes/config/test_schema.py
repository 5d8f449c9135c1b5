"""A Params is valid however it was made: the checks live beside the fields and run when it is built."""
import dataclasses
import os

import pytest

from spes.config.loader import flatten, load_params, params_from_dict, to_dict
from spes.config.schema import METHODS, ModelConfig, OptimConfig, Params, SyncConfig, TrainConfig
from spes.errors import ConfigError
from tests.conftest import ROOT

PARAMS_YAML = os.path.join(ROOT, "params.yaml")


def test_a_params_built_in_code_is_checked_when_built():
    # the case an outside review hit: a 4-expert model with the default merge.top_k trained both nodes and
    # only then failed in the aggregator
    with pytest.raises(ConfigError, match=r"merge\.top_k \(4\) must be < model\.num_experts \(4\)"):
        Params(model=ModelConfig(num_experts=4))
    with pytest.raises(ConfigError, match=r"sync\.method must be one of"):
        Params(sync=SyncConfig(method="fedsgd"))
    with pytest.raises(ConfigError, match=r"train\.optim\.lr must be > 0"):
        Params(train=TrainConfig(optim=OptimConfig(lr=0.0)))
    with pytest.raises(ConfigError, match=r"^dense\.optim\.beta2 must be in \[0, 1\), got 1\.0$"):  # the key that is wrong
        Params(dense=dataclasses.replace(Params().dense, optim=OptimConfig(beta2=1.0)))


def test_the_same_check_holds_on_every_path():
    """YAML, a node's JSON, code and a changed-then-revalidated Params fail with the same line."""
    msgs = []
    with pytest.raises(ConfigError) as e:
        load_params(PARAMS_YAML, ["train.seq_len=4096"])
    msgs.append(str(e.value))
    d = to_dict(Params())
    d["train"]["seq_len"] = 4096
    with pytest.raises(ConfigError) as e:
        params_from_dict(d)
    msgs.append(str(e.value))
    with pytest.raises(ConfigError) as e:
        Params(train=TrainConfig(seq_len=4096))
    msgs.append(str(e.value))
    p = Params()
    p.train.seq_len = 4096
    with pytest.raises(ConfigError) as e:
        p.validate()
    msgs.append(str(e.value))
    assert len(set(msgs)) == 1 and "train.seq_len (4096) exceeds model.max_seq_len (256)" in msgs[0]


def test_nonfinite_numbers_anywhere_are_named():
    with pytest.raises(ConfigError, match=r"compare\.lrs\.0 must be a finite number"):
        Params(compare=dataclasses.replace(Params().compare, lrs=[float("inf")]))


def test_the_defaults_and_every_method_validate():
    assert Params().validate() == params_from_dict(to_dict(Params()))
    for method in METHODS:
        kw = {"num_nodes": 1} if method == "centralized" else {}
        Params(sync=SyncConfig(method=method, **kw))
    assert flatten(to_dict(load_params(PARAMS_YAML)))  # the embedded default builds
