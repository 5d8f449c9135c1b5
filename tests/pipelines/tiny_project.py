"""A tiny SPES project on disk (stdlib json sources as corpus, 4 experts, 2 nodes) shared by the flow tests."""
import glob
import os
import sysconfig

import torch
import yaml

from spes.config import load_params
from spes.model import CausalLM
from spes.rounds import commit_initial, load_global
from spes.store import Store
from spes.tokenization import load_corpus, tokenize_corpus

PARAMS = {
    "model": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 4, "num_experts": 4, "top_k": 2, "max_seq_len": 64, "qk_norm": "full"},
    "spes": {"num_nodes": 2, "sync_steps": 3, "warmup_rounds": 2, "rounds": 3, "batch_size": 2, "seq_len": 32,
             "merge": {"interval": 6, "alpha_start": 0.05, "decay_steps": 100, "top_k": 2}},
    "orchestration": {"round_timeout_s": 300, "node_retries": 2},
    "dense": {"seq_len": 32}, "eval": {"seq_len": 32, "batches": 2, "batch_size": 2},
}


def make_project(root) -> None:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    tokenize_corpus(list(load_corpus(files)), str(root / "artifacts" / "tokens"), 512, None, 0.2, 0)
    p = dict(PARAMS, artifacts_dir=str(root / "artifacts"), storage={"url": str(root / "storage")})
    (root / "params.yaml").write_text(yaml.safe_dump(p))


def init_run(pfile, run) -> None:
    """Round 0 of `run`: a seeded from-scratch model, the same for every run."""
    p = load_params(pfile)
    torch.manual_seed(0)
    commit_initial(Store(p.storage.url, p.storage.options), run, CausalLM(p.model), "scratch")


def final_weights(pfile, run, r=3):
    p = load_params(pfile)
    return load_global(Store(p.storage.url, p.storage.options), run, r)[0].canonical_state_dict()


def assert_same(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
