"""Evaluation: held-out loss on fixed windows, and lm-eval's real task machinery on ../shared/eval data."""
import os

import numpy as np
import pytest
import torch

from spes.config import ModelConfig
from spes.evaluation import heldout_loss, run_lm_eval
from spes.hf import export_hf
from spes.model import CausalLM

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared")
ARC = os.path.join(SHARED, "eval", "hf_datasets", "ai2_arc", "ARC-Easy", "validation", "data-00000-of-00001.arrow")
TOK = os.path.join(SHARED, "tokenizers", "gpt-neox-olmo-dolma-v1_5.json")


def test_heldout_loss_of_uniform_model_is_log_vocab():
    model = CausalLM(ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                                 num_kv_heads=2, num_experts=2, top_k=1, max_seq_len=16))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    ev = heldout_loss(model, np.arange(200) % 50, batch_size=4, seq_len=16, num_batches=2)
    assert ev["loss"] == pytest.approx(np.log(50), rel=1e-5) and ev["tokens"] == 8 * 16


@pytest.mark.skipif(not (os.path.exists(ARC) and os.path.exists(TOK)), reason="shared eval data not present")
def test_lm_eval_arc_easy_on_exported_model(tmp_path):
    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "arc_easy_local.yaml").write_text(f"""task: arc_easy_local
dataset_path: arrow
dataset_kwargs:
  data_files:
    validation: {os.path.abspath(ARC)}
validation_split: validation
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
""")
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=50304, hidden_size=32, intermediate_size=16, num_layers=1, num_heads=4,
                                 num_kv_heads=4, num_experts=4, top_k=2, max_seq_len=512, qk_norm="full"))
    export_hf(model, str(tmp_path / "hf"), TOK)
    res = run_lm_eval(str(tmp_path / "hf"), ["arc_easy_local"], str(inc), limit=8, batch_size=4)
    assert 0.0 <= res["arc_easy_local"]["acc"] <= 1.0
