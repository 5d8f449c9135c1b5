"""Evaluation: held-out loss on fixed windows, and lm-eval's real task machinery on ../shared/eval data,
checked against our own log-likelihoods of the same requests."""
import os

import numpy as np
import pytest
import torch

from spes.data.tokenization import hf_tokenizer
from spes.eval.heldout import continuation_logprob, heldout_loss, lm_eval_results, lm_eval_summary
from spes.model.hf import export_hf
from spes.model.transformer import CausalLM
from tests.conftest import SHARED, tiny_config

ARC = os.path.join(SHARED, "eval", "hf_datasets", "ai2_arc", "ARC-Easy", "validation", "data-00000-of-00001.arrow")
TOK = os.path.join(SHARED, "tokenizers", "gpt-neox-olmo-dolma-v1_5.json")


def test_heldout_loss_of_uniform_model_is_log_vocab():
    model = CausalLM(tiny_config(vocab_size=50, num_layers=1))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    ev = heldout_loss(model, np.arange(200) % 50, batch_size=4, seq_len=16, num_batches=2)
    assert ev["loss"] == pytest.approx(np.log(50), rel=1e-5) and ev["tokens"] == 8 * 16


def test_long_scoring_says_what_it_does_and_gives_the_same_numbers(capsys):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=50, num_layers=1))
    tokens = np.arange(1000) % 47
    quiet = heldout_loss(model, tokens, batch_size=4, seq_len=16)
    told = heldout_loss(model, tokens, batch_size=4, seq_len=16, progress="evaluate: the final model")
    assert told == quiet
    assert "evaluate: the final model: scoring 62 windows of 16 tokens of the held-out split" in capsys.readouterr().err


ARC_TASK = """task: arc_easy_local
dataset_path: arrow
dataset_kwargs:
  data_files:
    validation: {arc}
validation_split: validation
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.skipif(not (os.path.exists(ARC) and os.path.exists(TOK)), reason="shared eval data not present")
def test_lm_eval_arc_easy_matches_our_own_loglikelihoods(tmp_path):
    from transformers import AutoTokenizer

    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "arc_easy_local.yaml").write_text(ARC_TASK.format(arc=os.path.abspath(ARC)))
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=50304, num_layers=1, max_seq_len=512, qk_norm="full", num_kv_heads=4))
    export_hf(model, str(tmp_path / "hf"), hf_tokenizer(TOK))
    res = lm_eval_results(str(tmp_path / "hf"), ["arc_easy_local"], str(inc), limit=8, batch_size=4, log_samples=True)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    correct = []
    for sample in res["samples"]["arc_easy_local"]:
        doc = sample["doc"]
        context = f"Question: {doc['question']}\nAnswer:"
        ours = [continuation_logprob(model, encode, context, " " + c) for c in doc["choices"]["text"]]
        theirs = [r[0][0] for r in sample["resps"]]
        assert ours == pytest.approx(theirs, abs=1e-3)
        correct.append(float(np.argmax(ours) == doc["choices"]["label"].index(doc["answerKey"])))
    assert len(correct) == 8
    assert res["results"]["arc_easy_local"]["acc,none"] == pytest.approx(np.mean(correct))
    summary = lm_eval_summary(res)
    assert summary["arc_easy_local"]["acc"] == pytest.approx(np.mean(correct))
