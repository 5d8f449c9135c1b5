"""bench/memory_plan.py's measuring child runs (it is a script in a string: nothing else imports it), for one
rank and for an fsdp node of two gloo ranks, at a toy size; its peak is what the planner sets its estimate
against."""
import sys

import pytest

from spes.config.schema import ModelConfig, OrchestrationConfig, Params, SyncConfig, TrainConfig
from tests.conftest import ROOT

sys.path.insert(0, f"{ROOT}/bench")
import memory_plan  # noqa: E402

TOY = dict(hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, num_experts=8, top_k=2,
           vocab_size=128, max_seq_len=memory_plan.SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,parallel", [(1, "ddp"), (2, "fsdp")])
def test_the_measuring_child_runs_and_reports_a_peak(ranks, parallel):
    p = Params(model=ModelConfig(**TOY), sync=SyncConfig(num_nodes=2),
               train=TrainConfig(batch_size=2, micro_batch_size=1, seq_len=32, node_parallel=parallel),
               orchestration=OrchestrationConfig(gpus_per_node=ranks))
    got = memory_plan.measure(p)
    assert got["device"] == "cpu" and got["peak"] > 0
