"""A tiny SPES project on disk (the session's tiny tokens, 4 experts, 2 nodes) shared by the flow tests."""
import shutil

import torch
import yaml

from spes.config.loader import load_params
from spes.model.transformer import CausalLM
from spes.run.identity import InitModel, settings_fingerprint
from spes.run.run import Run
from spes.storage.store import Store

PARAMS = {
    "model": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 4, "num_experts": 4, "top_k": 2, "max_seq_len": 64, "qk_norm": "full"},
    "sync": {"num_nodes": 2, "every_steps": 3, "warmup_rounds": 2, "rounds": 3},
    "train": {"batch_size": 2, "seq_len": 32},
    "merge": {"interval": 6, "alpha_start": 0.05, "decay_steps": 100, "top_k": 2},
    "orchestration": {"round_timeout_s": 300, "node_retries": 2},
    "dense": {"seq_len": 32}, "eval": {"seq_len": 32, "batches": 2, "batch_size": 2},
}
INIT_SEED = 0


def make_project(root, tokens: str) -> None:
    shutil.copytree(tokens, root / "artifacts" / "tokens")
    # keep_rounds 3: every round of these 3-round runs stays whole, so tests can resume from any of them
    p = dict(PARAMS, artifacts_dir=str(root / "artifacts"), storage={"url": str(root / "storage"), "keep_rounds": 3})
    p["orchestration"] = dict(PARAMS["orchestration"], node_cache_dir=str(root / "node-cache"))
    (root / "params.yaml").write_text(yaml.safe_dump(p))


def init_run(pfile, run, overrides=()) -> None:
    """Round 0 of `run`: a seeded from-scratch model, the same for every run."""
    p = load_params(pfile, list(overrides))
    torch.manual_seed(INIT_SEED)
    init = InitModel.from_state(CausalLM(p.model).canonical_state_dict(), p.model, "scratch")
    Run(Store.from_config(p.storage), run).ensure(settings_fingerprint(p), init)


def final_weights(pfile, run, r=3):
    p = load_params(pfile)
    return Run(Store.from_config(p.storage), run).load_model(r)[0].canonical_state_dict()


def assert_same(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
