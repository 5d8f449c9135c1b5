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


def test_accuracy_is_the_share_of_tokens_whose_likeliest_next_token_is_right():
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=50, num_layers=1))
    tokens = np.arange(300) % 7  # a pattern a model can get partly right by chance
    ev = heldout_loss(model, tokens, batch_size=4, seq_len=16, num_batches=3)
    x = torch.from_numpy(tokens[: 12 * 16 + 1].astype("int64"))
    right = 0
    with torch.no_grad():
        for w in range(12):
            window = x[w * 16: w * 16 + 17]
            right += int((model(window[None, :-1]).logits[0].argmax(-1) == window[1:]).sum())
    assert ev["accuracy"] == right / (12 * 16) and ev["tokens"] == 12 * 16


def test_long_scoring_says_what_it_does_and_gives_the_same_numbers(capsys):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=50, num_layers=1))
    tokens = np.arange(1000) % 47
    quiet = heldout_loss(model, tokens, batch_size=4, seq_len=16)
    told = heldout_loss(model, tokens, batch_size=4, seq_len=16, progress="evaluate: the final model")
    assert told == quiet
    assert "evaluate: the final model: scoring 62 windows of 16 tokens of the held-out split" in capsys.readouterr().err


def test_scored_windows_follow_the_eval_settings(tiny_tokens):
    from spes.config.schema import EvalConfig
    from spes.data.tokens import TokenData, window_documents
    from spes.errors import ConfigError
    from spes.eval.heldout import heldout_windows

    data = TokenData.open(tiny_tokens)
    e = EvalConfig(seq_len=16, batch_size=4, batches=3, round_batches=2)
    every = heldout_windows(e, data, whole=True)
    assert len(every) == (len(data.val) - 1) // 16 and len(heldout_windows(e, data)) == 12
    assert heldout_windows(e, data, per_round=True).tolist() == [every[i * len(every) // 8] for i in range(8)]
    docs = window_documents(data.val, data.eos_id, 16, len(every), every)
    cap = min(np.bincount(docs)[np.bincount(docs) > 0]) + 1  # at least one document has more windows than this
    capped = heldout_windows(EvalConfig(seq_len=16, max_windows_per_document=cap), data, whole=True)
    kept = window_documents(data.val, data.eos_id, 16, len(capped), capped)
    assert max(np.bincount(kept)) == cap < max(np.bincount(docs)) and set(kept) == set(docs)
    with pytest.raises(ConfigError, match="eval.max_windows_per_document must be >= 1 or null, got 0"):
        EvalConfig(max_windows_per_document=0).validate()


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


def test_a_long_score_says_how_far_it_is_every_30_s_where_output_is_a_log():
    """Not a terminal (DVC, CI, a pipe): no bar, a line at least every 30 s (the evaluate stage once ran 11
    minutes printing three lines)."""
    import io

    from spes.eval.heldout import progress_lines

    ticks = iter([0.0, 10.0, 31.0, 40.0, 62.0, 95.0, 96.0])  # the start, then after each of six batches
    out = io.StringIO()
    assert list(progress_lines(range(6), "evaluate", 6, clock=lambda: next(ticks), out=out)) == list(range(6))
    assert out.getvalue().splitlines() == ["evaluate: 2/6 batches (33%), 31 s", "evaluate: 4/6 batches (67%), 62 s",
                                           "evaluate: 5/6 batches (83%), 95 s"]
