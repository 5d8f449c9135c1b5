"""One training step (fwd+bwd+AdamW) side by side in one process:
  1. our MoE vs Hugging Face OlmoeForCausalLM (its fastest available experts implementation) on the same
     config, weights and batch -> tokens/s ratio;
  2. our SPES node step (own experts only trainable) vs our full-model step -> time and peak-memory ratio.
Usage: python bench/moe_step.py [--steps 5] [--nodes 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from spes.config import ModelConfig, OptimConfig  # noqa: E402
from spes.hf import to_hf  # noqa: E402
from spes.model import CausalLM  # noqa: E402
from spes.trainer import NodeTrainer  # noqa: E402


def timed(fn, steps):
    fn()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                      num_kv_heads=8, num_experts=16, top_k=2, max_seq_len=a.seq, qk_norm="full")
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=dev)
    tokens = x.numel()

    ours = CausalLM(cfg).to(dev)
    hf = to_hf(ours).to(dev).train()
    impl = "eager"
    for cand in ("grouped_mm", "batched_mm"):
        try:
            hf.set_experts_implementation(cand) if hasattr(hf, "set_experts_implementation") else None
            hf.config._experts_implementation = cand
            hf(x[:1, :8])
            impl = cand
            break
        except Exception:
            continue
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    full = NodeTrainer(ours, range(cfg.num_experts), OptimConfig(lr=1e-3), 100)

    def hf_step():
        out = hf(x, labels=x)
        opt_hf.zero_grad(set_to_none=True)
        out.loss.backward()
        opt_hf.step()

    t_ours = timed(lambda: full.train_step(x, x, 50), a.steps)
    t_hf = timed(hf_step, a.steps)
    print(f"device {dev}; experts impl of HF: {impl}")
    print(f"ours  {tokens / t_ours:9.0f} tok/s   HF {tokens / t_hf:9.0f} tok/s   ratio ours/HF = {t_hf / t_ours:.2f}x")

    def peak(make):
        if dev == "cuda":
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            tr = make(); t = timed(lambda: tr.train_step(x, x, 50), a.steps)
            return t, (torch.cuda.max_memory_allocated() - base) / 2**20
        tracemalloc.start()
        tr = make(); t = timed(lambda: tr.train_step(x, x, 50), a.steps)
        cur, pk = tracemalloc.get_traced_memory(); tracemalloc.stop()
        # tracemalloc misses torch's allocator; report parameter+grad+optimizer bytes instead on CPU
        b = sum(p.numel() * p.element_size() for p in tr.model.parameters())
        b += sum(p.numel() * p.element_size() * 3 for _, p in tr.trainable_named_parameters())  # grad + 2 Adam moments
        return t, b / 2**20

    k = cfg.num_experts // a.nodes
    torch.manual_seed(0)
    t_full, m_full = peak(lambda: NodeTrainer(CausalLM(cfg).to(dev), range(cfg.num_experts), OptimConfig(), 100))
    torch.manual_seed(0)
    t_node, m_node = peak(lambda: NodeTrainer(CausalLM(cfg).to(dev), range(k), OptimConfig(), 100))
    kind = "peak MiB" if dev == "cuda" else "weights+grads+Adam MiB"
    print(f"full step {t_full * 1e3:8.1f} ms  {kind} {m_full:8.1f}")
    print(f"node step {t_node * 1e3:8.1f} ms  {kind} {m_node:8.1f}   ({k}/{cfg.num_experts} experts trainable)")
    print(f"node/full time = {t_node / t_full:.2f}   memory = {m_node / m_full:.2f}")

    if dev == "cuda":  # fp32 experts: grouped_mm has no fp32 CUDA kernel, so auto picks Triton over the loop
        import dataclasses

        times = {}
        for impl in ("loop", "triton"):
            torch.manual_seed(0)
            tr = NodeTrainer(dataclasses.replace(cfg, experts_impl=impl).build().to(dev), range(cfg.num_experts),
                             OptimConfig(), 100)
            times[impl] = timed(lambda: tr.train_step(x, x, 50), a.steps)
        print(f"fp32 full step: experts loop {times['loop'] * 1e3:.1f} ms, Triton {times['triton'] * 1e3:.1f} ms "
              f"= {times['loop'] / times['triton']:.2f}x")


if __name__ == "__main__":
    main()
