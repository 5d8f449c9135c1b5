"""One training step (fwd+bwd+AdamW) side by side in one process:
  1. our MoE vs Hugging Face OlmoeForCausalLM (its fastest available experts implementation) on the same
     config, weights and batch -> tokens/s ratio, eager and with torch.compile (our blocks / HF's model);
  2. model FLOPs utilization: the step's model FLOPs (6 x active matmul parameters per token, plus causal
     attention) per second over the matmul peak measured on this machine in this run (fp32 on the CPU,
     bf16 on a GPU);
  3. our SPES node step (own experts only trainable) vs our full-model step -> time and memory ratio.
Usage: python bench/moe_step.py [--steps 5] [--nodes 4] [--no-compile] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import tracemalloc

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from spes.config.schema import ModelConfig, OptimConfig  # noqa: E402
from spes.model.hf import to_hf  # noqa: E402
from spes.model.transformer import CausalLM  # noqa: E402
from spes.train.trainer import Trainer  # noqa: E402


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


def matmul_peak(dev: str, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a large square matmul here: the machine's attainable peak for dense work."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, reps)


def step_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one training step: 6 per active matmul parameter per token (forward 2, backward 4;
    top_k experts of E, embeddings excluded), plus causal attention scores and mixing (forward 2 x S x Q per
    token and layer, half of it masked, times 3)."""
    D, I, E, K, Q = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, cfg.num_heads * cfg.dim_per_head
    KV = cfg.num_kv_heads * cfg.dim_per_head
    attn = D * (2 * Q + 2 * KV)
    mlp = (K * 3 * D * I + E * D) if cfg.is_moe else 3 * D * I
    active = cfg.num_layers * (attn + mlp) + cfg.vocab_size * D
    return batch * seq * (6 * active + 6 * cfg.num_layers * seq * Q)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", action="store_true")
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
    full = Trainer(ours, range(cfg.num_experts), OptimConfig(lr=1e-3), 100)

    def hf_step(model=hf):
        out = model(x, labels=x)
        opt_hf.zero_grad(set_to_none=True)
        out.loss.backward()
        opt_hf.step()

    t_ours = timed(lambda: full.train_step(x, x, 50), a.steps)
    t_hf = timed(hf_step, a.steps)
    print(f"device {dev}; experts impl of HF: {impl}")
    print(f"ours  {tokens / t_ours:9.0f} tok/s   HF {tokens / t_hf:9.0f} tok/s   ratio ours/HF = {t_hf / t_ours:.2f}x")
    peak_dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    peak_flops = matmul_peak(dev, peak_dtype)
    flops = step_flops(cfg, a.batch, a.seq)
    mfu = flops / t_ours / peak_flops
    print(f"matmul peak {peak_flops / 1e9:.1f} GFLOP/s ({str(peak_dtype).removeprefix('torch.')}); our step "
          f"{flops / t_ours / 1e9:.1f} GFLOP/s of model FLOPs = MFU {mfu:.2f}")
    t_ours_c = t_hf_c = math.nan
    if not a.no_compile:
        for block in ours.model.layers:
            block.compile()
        hf_c = torch.compile(hf)
        t_ours_c = timed(lambda: full.train_step(x, x, 50), a.steps)
        t_hf_c = timed(lambda: hf_step(hf_c), a.steps)
        print(f"compiled: ours {tokens / t_ours_c:9.0f} tok/s (eager/compiled {t_ours / t_ours_c:.2f}x), HF "
              f"{tokens / t_hf_c:9.0f} tok/s; ratio ours/HF compiled = {t_hf_c / t_ours_c:.2f}x; MFU compiled "
              f"{flops / t_ours_c / peak_flops:.2f}")

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
    t_full, m_full = peak(lambda: Trainer(CausalLM(cfg).to(dev), range(cfg.num_experts), OptimConfig(), 100))
    torch.manual_seed(0)
    t_node, m_node = peak(lambda: Trainer(CausalLM(cfg).to(dev), range(k), OptimConfig(), 100))
    kind = "peak MiB" if dev == "cuda" else "weights+grads+Adam MiB"
    print(f"full step {t_full * 1e3:8.1f} ms  {kind} {m_full:8.1f}")
    print(f"node step {t_node * 1e3:8.1f} ms  {kind} {m_node:8.1f}   ({k}/{cfg.num_experts} experts trainable)")
    print(f"node/full time = {t_node / t_full:.2f}   memory = {m_node / m_full:.2f}")
    compiled = not a.no_compile
    results = {"ratio_vs_hf": t_hf / t_ours, "ratio_vs_hf_compiled": t_hf_c / t_ours_c if compiled else None,
               "mfu": mfu, "mfu_compiled": flops / t_ours_c / peak_flops if compiled else None,
               "node_vs_full_time": t_node / t_full, "compiled_vs_eager": t_ours / t_ours_c if compiled else None,
               "tokens_per_s": tokens / t_ours, "peak_flops": peak_flops}

    if dev == "cuda":  # fp32 experts: grouped_mm has no fp32 CUDA kernel, so auto picks Triton over the loop
        import dataclasses

        times = {}
        for impl in ("loop", "triton"):
            torch.manual_seed(0)
            tr = Trainer(CausalLM(dataclasses.replace(cfg, experts_impl=impl)).to(dev), range(cfg.num_experts),
                             OptimConfig(), 100)
            times[impl] = timed(lambda: tr.train_step(x, x, 50), a.steps)
        print(f"fp32 full step: experts loop {times['loop'] * 1e3:.1f} ms, Triton {times['triton'] * 1e3:.1f} ms "
              f"= {times['loop'] / times['triton']:.2f}x")
        results["triton_vs_loop_fp32"] = times["loop"] / times["triton"]
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
