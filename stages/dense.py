"""DVC stage `dense`: short dense pre-training whose HF checkpoint `upcycle` consumes.

Runs only when init.mode=upcycle and no init.dense_checkpoint is named; otherwise records that it was skipped.
Reads artifacts/tokens; writes artifacts/dense/hf (a Hugging Face checkpoint), artifacts/dense/metrics.json and invocation.json.
Example: python -m stages.dense dense.steps=300
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time

from stages.common import out_dir, parse, run, write_metrics


def main() -> None:
    _, p = parse(__doc__)
    d = out_dir(p, "dense")
    hf_dir = os.path.join(d, "hf")
    if p.init.mode != "upcycle" or p.init.dense_checkpoint is not None:
        shutil.rmtree(hf_dir, ignore_errors=True)
        os.makedirs(hf_dir)  # the stage's out, empty: upcycle reads init.dense_checkpoint (or starts from scratch)
        write_metrics(d, {"skipped": True})
        print("dense: skipped (init.mode is not upcycle, or init.dense_checkpoint is given)")
        return
    import torch

    from spes.data.tokenization import hf_tokenizer
    from spes.data.tokens import BatchStream, TokenData, check_vocab
    from spes.eval.heldout import heldout_loss, heldout_windows
    from spes.model.hf import export_hf
    from spes.model.transformer import CausalLM
    from spes.train.devices import resolve_device
    from spes.train.trainer import Trainer

    torch.manual_seed(p.dense.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokens = os.path.join(p.artifacts_dir, "tokens")
    data = TokenData.open(tokens)
    check_vocab(p.model.vocab_size, data, tokens)
    model = CausalLM(dataclasses.replace(p.model, num_experts=0)).to(resolve_device(p.orchestration.device))
    trainer = Trainer(model, (), p.dense.optim, p.dense.steps, autocast_dtype=p.train.autocast)
    # one reader in the run's data order, keyed by its own seed
    stream = BatchStream(data.train, p.dense.batch_size, p.dense.seq_len, p.dense.seed, node=0, order=p.data.order)
    e, windows = p.eval, heldout_windows(p.eval, data)
    before = heldout_loss(model, data.val, e.batch_size, e.seq_len, starts=windows)["loss"]
    t0 = time.time()
    for step in range(p.dense.steps):
        m = trainer.train_step(*stream.next(), step)
        if step % 50 == 0 or step == p.dense.steps - 1:
            print(f"dense step {step}: loss {float(m.ce):.4f}")
    secs = time.time() - t0
    after = heldout_loss(model, data.val, e.batch_size, e.seq_len, starts=windows)["loss"]
    model.to("cpu")
    arch = {"auto": None}.get(p.dense.export_arch, p.dense.export_arch)
    shutil.rmtree(hf_dir, ignore_errors=True)
    export_hf(model, hf_dir, hf_tokenizer(os.path.join(p.artifacts_dir, "tokens", "tokenizer.json")), arch)
    write_metrics(d, {"skipped": False, "steps": p.dense.steps, "seconds": round(secs, 2),
                      "heldout_loss_before": before, "heldout_loss_after": after})
    print(f"dense: {p.dense.steps} steps in {secs:.1f}s, held-out loss {before:.4f} -> {after:.4f}; HF model at {hf_dir}")


if __name__ == "__main__":
    run(main)
