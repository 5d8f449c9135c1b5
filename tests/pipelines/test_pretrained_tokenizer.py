"""A pretrained tokenizer end to end through the DVC entry points: OLMo's GPT-NeoX BPE (~50k ids, uint16
shards) -> tokenize -> dense -> upcycle on a tiny model; the exported HF model carries the tokenizer with
its EOS."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from spes.data.tokens import TokenData
from tests.conftest import SHARED, json_sources

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLMO = os.path.join(SHARED, "tokenizers", "gpt-neox-olmo-dolma-v1_5.json")


@pytest.mark.skipif(not os.path.exists(OLMO), reason="shared tokenizer not present")
def test_olmo_tokenizer_through_tokenize_dense_upcycle(tmp_path):
    params = {
        "artifacts_dir": str(tmp_path / "artifacts"),
        "model": {"vocab_size": 50304, "hidden_size": 32, "intermediate_size": 32, "num_layers": 1, "num_heads": 4,
                  "num_kv_heads": 4, "num_experts": 8, "top_k": 2, "max_seq_len": 128, "norm_topk_prob": True,
                  "qk_norm": "head"},
        "tokenize": {"corpus": ",".join(json_sources()), "tokenizer": OLMO, "val_fraction": 0.2},
        "dense": {"steps": 10, "batch_size": 2, "seq_len": 32},
        "eval": {"batches": 2, "batch_size": 2, "seq_len": 32},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for stage in ("tokenize", "dense", "upcycle"):
        r = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--params", str(tmp_path / "params.yaml")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{stage}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    data = TokenData.open(str(tmp_path / "artifacts/tokens"))
    assert data.train.dtype == np.uint16 and data.vocab_size == 50280 and data.eos_id == 50279
    stats = json.load(open(tmp_path / "artifacts/tokenize/metrics.json"))
    assert stats["files"] == len(json_sources()) and stats["train_tokens"] == len(data.train)
    dense = json.load(open(tmp_path / "artifacts/dense/metrics.json"))
    assert dense["heldout_loss_after"] < dense["heldout_loss_before"]
    assert json.load(open(tmp_path / "artifacts/init/metrics.json"))["max_abs_logit_diff_vs_dense"] < 1e-4
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "artifacts/dense/hf"))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 50279
