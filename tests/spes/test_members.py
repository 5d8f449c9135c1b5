"""`python -m spes.members`: join with a memory cap from the planner, refusals in one line, show."""
import pytest
import torch
import yaml

from spes.config.loader import to_dict
from spes.errors import MembershipError, SpesError
from spes.members import main
from spes.model.transformer import CausalLM
from spes.run.identity import InitModel, settings_fingerprint
from spes.run.layout import RunLayout
from spes.run.membership import read_requests
from spes.run.run import Run
from spes.storage.store import Store
from tests.conftest import tiny_params


@pytest.fixture
def params_file(tmp_path):
    p = tiny_params(vocab_size=512)
    p.sync.num_nodes, p.train.seq_len, p.train.batch_size, p.merge.top_k = 2, 16, 2, 2
    p.dense.seq_len = p.eval.seq_len = 16
    p.storage.url, p.orchestration.run_name = str(tmp_path / "storage"), "m"
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(to_dict(p)))
    torch.manual_seed(0)
    Run(Store.from_config(p.storage), "m").ensure(
        settings_fingerprint(p), InitModel.from_state(CausalLM(p.model).canonical_state_dict(), p.model, "x"))
    return str(f), Store.from_config(p.storage)


def test_join_with_a_memory_cap_and_refusals(params_file, capsys):
    f, store = params_file
    with pytest.raises(SpesError, match=r"node 5 \(0.00 GiB\): owning even one expert per layer needs"):
        main(["join", "--node", "5", "--gpu-mem", "1KiB", "--params", f])
    with pytest.raises(MembershipError, match="node 1 is already a member of run 'm'"):
        main(["join", "--node", "1", "--params", f])
    assert read_requests(store, RunLayout("m")) == []  # nothing written
    main(["join", "--node", "5", "--gpu-mem", "80GiB", "--params", f])
    assert "node 5 will join at the next round boundary (owning at most 4 experts per layer)" in capsys.readouterr().out
    (q,) = read_requests(store, RunLayout("m"))
    assert (q.kind, q.node, q.max_experts, q.at_round) == ("join", 5, 4, None)
    main(["show", "--params", f])
    assert "node 1: experts [2, 3], data slot 1, missed 0 in a row" in capsys.readouterr().out
