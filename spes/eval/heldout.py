"""Evaluation helpers: held-out loss/perplexity on fixed windows, and lm-eval harness tasks."""
from __future__ import annotations

import math
import sys
import time
from typing import Iterator, Optional, Union

import numpy as np
import torch

from spes.config.stages import EvalConfig
from spes.data.shards import TokenSequence
from spes.data.tokens import TokenData, as_sequence, eval_batches, eval_window_starts, heldout_window_starts
from spes.model.transformer import CausalLM


@torch.no_grad()
def heldout_loss(model: CausalLM, tokens: Union[np.ndarray, TokenSequence], batch_size: int, seq_len: int,
                 num_batches: Optional[int] = None, spread: bool = False, progress: Optional[str] = None,
                 starts: Optional[np.ndarray] = None) -> dict:
    """Mean next-token loss over fixed windows of the held-out split (all of it when num_batches is None),
    with the standard error of that mean estimated from the spread of the per-window means, the share of
    tokens whose most likely next token is the right one (`accuracy`, top-1), and those per-window means (two models on the same windows compare paired: spes/eval/compare.py). `progress`: what
    is being scored, said on stderr before it starts (with a tqdm bar of the windows on a terminal). `starts`:
    the windows to score (heldout_windows), in place of num_batches and spread."""
    model.eval()
    device = next(model.parameters()).device
    per_window, correct = [], 0
    if starts is None:
        starts = eval_window_starts(len(as_sequence(tokens)), seq_len,
                                    None if num_batches is None else num_batches * batch_size, spread)
    batches = eval_batches(tokens, batch_size, seq_len, starts=starts)
    if progress is not None:
        batches = _with_progress(batches, progress, len(starts), batch_size, seq_len)
    for x, y in batches:
        logits = model(x.to(device)).logits.float()
        nll_BS = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.to(device), reduction="none")
        per_window.append(nll_BS.double().mean(dim=1))
        correct += int((logits.argmax(dim=-1) == y.to(device)).sum())
    w = torch.cat(per_window)  # every window has seq_len tokens: the loss is the mean of the window means
    loss = w.mean().item()
    se = (w.std(unbiased=True) / math.sqrt(len(w))).item() if len(w) > 1 else float("nan")
    return {"loss": loss, "se": se, "perplexity": math.exp(min(loss, 50.0)), "tokens": len(w) * seq_len,
            "windows": len(w), "per_window": w.tolist(), "accuracy": correct / (len(w) * seq_len)}


def _with_progress(batches, what: str, windows: int, batch_size: int, seq_len: int):
    print(f"{what}: scoring {windows:,} windows of {seq_len} tokens of the held-out split", file=sys.stderr, flush=True)
    total = -(-windows // batch_size)
    if not sys.stderr.isatty():  # a log, not a terminal: a line every PROGRESS_EVERY_S instead of a bar
        return progress_lines(batches, what, total)
    from tqdm import tqdm

    return tqdm(batches, total=total, unit="batch", desc=what, leave=False)


PROGRESS_EVERY_S = 30.0
"""Where output is a log (DVC, CI, a pipe): how often a long score says how far it is."""


def progress_lines(items, what: str, total: int, every_s: float = PROGRESS_EVERY_S, clock=time.monotonic,
                   out=None) -> Iterator:
    """`items`, saying on `out` (stderr) how many of `total` are done at least every `every_s` seconds."""
    out = out if out is not None else sys.stderr
    t0 = last = clock()
    for done, item in enumerate(items, 1):
        yield item
        now = clock()
        if now - last >= every_s:
            print(f"{what}: {done}/{total} batches ({100 * done / max(total, 1):.0f}%), {now - t0:.0f} s", file=out,
                  flush=True)
            last = now


def heldout_windows(e: EvalConfig, data: TokenData, per_round: bool = False, whole: bool = False) -> np.ndarray:
    """Start offsets of the held-out windows a score uses: the `evaluate` stage's (the first eval.batches
    batches; all when None), the whole split (`whole`, the comparison's final score) or the per-round slice
    (`per_round`: eval.round_batches batches, spread or first); never more than eval.max_windows_per_document
    of one document."""
    count: Optional[int] = None
    if per_round:
        count = e.round_batches * e.batch_size
    elif not whole and e.batches is not None:
        count = e.batches * e.batch_size
    spread = per_round and e.round_windows == "spread"
    return heldout_window_starts(data.val, data.eos_id, e.seq_len, count, spread, e.max_windows_per_document)


@torch.no_grad()
def continuation_logprob(model: CausalLM, encode, context: str, continuation: str) -> float:
    """log p(continuation | context) under `model`, tokenized as lm-eval's causal models do: trailing spaces
    of the context move to the continuation, the pair is encoded whole and split at the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    cont = whole[len(ctx):]
    ids = torch.tensor((ctx + cont)[:-1]).unsqueeze(0)
    device = next(model.parameters()).device
    logp = torch.log_softmax(model.eval()(ids.to(device)).logits.float()[0, -len(cont):], dim=-1)
    return logp.gather(1, torch.tensor(cont, device=device).unsqueeze(1)).sum().item()


def lm_eval_results(hf_dir: str, tasks: list[str], include_path: Optional[str] = None, limit: Optional[int] = None,
                    batch_size: int = 8, log_samples: bool = False) -> dict:
    """lm-eval's own result dict for an exported HF directory (fp32, CPU)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf_dir},dtype=float32,device=cpu",
                                   tasks=tasks, task_manager=tm, limit=limit, batch_size=batch_size,
                                   log_samples=log_samples)


def lm_eval_summary(res: dict) -> dict:
    """{task: {metric: value}} from lm-eval's result dict (no aliases, no stderr)."""
    out = {}
    for task, metrics in res["results"].items():
        out[task] = {k.split(",")[0]: float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not k.startswith("alias") and "stderr" not in k}
    return out


def run_lm_eval(hf_dir: str, tasks: list[str], include_path: Optional[str] = None,
                limit: Optional[int] = None, batch_size: int = 8) -> dict:
    """lm-eval on an exported HF directory; returns {task: {metric: value}}."""
    return lm_eval_summary(lm_eval_results(hf_dir, tasks, include_path, limit, batch_size))
