"""The CUDA path checked on one GPU in one run (under 6 minutes on an H200), one JSON line at the end.

  env          torch / CUDA / Triton / transformers versions, the device
  matmul_peak  bf16 matmul FLOP/s measured here (the MFU denominator)
  moe_step     a bf16-autocast training step (fwd+bwd+AdamW) of our MoE vs Hugging Face OlmoeForCausalLM on
               the same config, weights and batch: tokens/s of both, MFU of ours
  grouped_gemm the Triton grouped GEMM vs torch's grouped_mm in bf16, forward and backward: max error, time
  chunked_loss model.loss_impl chunked vs plain at 8 x 2048 tokens, vocabulary 151,665, with the LM-head
               z-loss: loss and gradient error, peak memory of each
  planner      spes/train/plan.py vs torch.cuda.max_memory_allocated for a node of configs/spes-1b.yaml (bf16
               autocast, frozen experts bf16, block checkpointing, chunked loss) at micro-batches 1 and 2
  node_round   one SPES node round of a small model on CUDA vs the same round on the CPU (fp32): losses and
               the uploaded delta within bf16-level tolerance

Each check reports its own error instead of stopping the others. On the device machine (PyTorch, Triton,
transformers; no network, no omegaconf), carry the two pure-Python wheels the config loader needs:

    pip download --no-deps omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 -d .wheels   # here, once
    # run(carry=[".wheels"]):
    pip install --no-index --no-deps .wheels/* -q; python bench/gpu_check.py

`--smoke` runs every check at toy sizes on whatever device there is (the CPU in tests/bench/; Triton then
needs TRITON_INTERPRET=1): it checks that the script runs, it measures nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from moe_step import matmul_peak, step_flops, timed  # noqa: E402

from spes.config.schema import DenseConfig, EvalConfig, MergeConfig, ModelConfig, OptimConfig, Params, TrainConfig  # noqa: E402
from spes.model.transformer import CausalLM  # noqa: E402
from spes.train.trainer import Trainer  # noqa: E402

GiB = 2**30


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_of(fn: Callable[[], object], dev: torch.device) -> tuple[object, int]:
    """fn's result and the bytes it allocated at its peak above what was allocated before (0 on the CPU)."""
    if dev.type != "cuda":
        return fn(), 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    _sync()
    return out, torch.cuda.max_memory_allocated() - base


def check_env(a, dev) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(dev)}
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["gpu_mem_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / GiB, 1)
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # reported, not fatal
            out[mod] = f"missing: {e}"
    return out


def check_matmul_peak(a, dev) -> dict:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = 256 if a.smoke else 8192
    return {"flops": matmul_peak(str(dev), dtype, n=n, reps=3 if a.smoke else 20), "dtype": str(dtype)}


def moe_config(a) -> ModelConfig:
    if a.smoke:
        return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=4, num_experts=4, top_k=2, max_seq_len=64, qk_norm="full")
    return ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=1024, num_layers=8, num_heads=16,
                       num_kv_heads=16, num_experts=16, top_k=2, max_seq_len=2048, qk_norm="full")


def check_moe_step(a, dev, peak: float) -> dict:
    from spes.model.hf import to_hf

    cfg = moe_config(a)
    batch, seq, steps = (2, 32, 1) if a.smoke else (8, 2048, 5)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    ours = CausalLM(cfg).to(dev)
    hf = to_hf(ours).to(dev).train()
    impl = "eager"
    for cand in ("grouped_mm", "batched_mm"):  # HF's fastest experts implementation that runs here
        try:
            if hasattr(hf, "set_experts_implementation"):
                hf.set_experts_implementation(cand)
            hf.config._experts_implementation = cand
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                hf(x[:1, :8])
            impl = cand
            break
        except Exception:
            continue
    trainer = Trainer(ours, range(cfg.num_experts), OptimConfig(lr=1e-4), 100, autocast_dtype="bfloat16")
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def hf_step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = hf(x, labels=x)
        opt_hf.zero_grad(set_to_none=True)
        out.loss.backward()
        opt_hf.step()

    t_ours = timed(lambda: trainer.train_step(x, x, 50), steps)
    t_hf = timed(hf_step, steps)
    flops = step_flops(cfg, batch, seq)
    return {"config": {k: getattr(cfg, k) for k in ("hidden_size", "num_layers", "num_experts", "top_k",
                                                      "intermediate_size", "vocab_size")},
            "tokens": batch * seq, "ours_tokens_per_s": batch * seq / t_ours, "hf_tokens_per_s": batch * seq / t_hf,
            "ours_over_hf": t_hf / t_ours, "hf_experts_impl": impl, "mfu_ours": flops / t_ours / peak,
            "mfu_hf": flops / t_hf / peak}


def check_grouped_gemm(a, dev) -> dict:
    from spes.model.kernels.triton_grouped import triton_grouped_linear
    from spes.model.moe import _grouped_mm

    S, D, O, E = (256, 64, 128, 4) if a.smoke else (16384, 1024, 2048, 16)
    # CUDA's grouped_mm is bf16-only; Triton's CPU interpreter cannot do bf16 dots (triton-lang/triton#11584)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, E, (S,), generator=g), minlength=E).to(dev)
    x = torch.randn(S, D, generator=g).to(dev, dtype).requires_grad_()
    w = (torch.randn(E, O, D, generator=g) * D**-0.5).to(dev, dtype).requires_grad_()
    dy = torch.randn(S, O, generator=g).to(dev, dtype)
    out = {}
    for name, fn in (("grouped_mm", _grouped_mm), ("triton", triton_grouped_linear)):
        if name == "grouped_mm" and not hasattr(torch.nn.functional, "grouped_mm"):
            out[name] = {"error": f"torch {torch.__version__} has no grouped_mm"}
            continue
        y = fn(x, w, counts)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
        fwd = timed(lambda: fn(x, w, counts), 2 if a.smoke else 20)
        both = timed(lambda: torch.autograd.grad(fn(x, w, counts), (x, w), dy), 2 if a.smoke else 20)
        out[name] = {"y": y.detach().float(), "gx": gx.float(), "gw": gw.float(), "forward_ms": fwd * 1e3,
                     "forward_backward_ms": both * 1e3}
    with torch.no_grad():
        ref = {"y": torch.cat([xe.float() @ w[e].float().t() for e, xe in enumerate(torch.split(x, counts.tolist()))])}
    res = {"rows": S, "in": D, "out": O, "experts": E, "dtype": str(dtype)}
    for name, r in out.items():
        if "error" in r:
            res[name] = r
            continue
        res[name] = {"forward_ms": r["forward_ms"], "forward_backward_ms": r["forward_backward_ms"],
                     "max_rel_err_y_vs_fp32": float((r["y"] - ref["y"]).abs().max() / ref["y"].abs().max().detach())}
    if all("error" not in out[n] for n in out):
        a_, b_ = out["triton"], out["grouped_mm"]
        res["triton_vs_grouped_mm"] = {k: float((a_[k] - b_[k]).abs().max() / b_[k].abs().max()) for k in ("y", "gx", "gw")}
        res["triton_over_grouped_mm_time"] = a_["forward_backward_ms"] / b_["forward_backward_ms"]
    return res


def check_chunked_loss(a, dev) -> dict:
    from spes.model.losses import chunked_linear_cross_entropy

    N, D, V, chunk = (128, 32, 1000, 32) if a.smoke else (8 * 2048, 768, 151665, 1024)
    z = 1e-5
    g = torch.Generator().manual_seed(0)
    h0 = (torch.randn(N, D, generator=g)).to(dev)
    w0 = (torch.randn(V, D, generator=g) * D**-0.5).to(dev)
    y = torch.randint(0, V, (N,), generator=g).to(dev)

    def plain():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logits = (h @ w.t()).float()
        loss = torch.nn.functional.cross_entropy(logits, y) + z * torch.logsumexp(logits, -1).square().mean()
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def chunked():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        ce, zl = chunked_linear_cross_entropy(h, w, y, chunk)
        loss = ce + z * zl
        loss.backward()
        return loss.detach(), h.grad, w.grad

    (lp, hp, wp), mem_plain = _peak_of(plain, dev)
    (lc, hc, wc), mem_chunked = _peak_of(chunked, dev)
    inputs = (h0.numel() + w0.numel()) * 4 * 2  # the two leaves and their gradients, in both
    return {"tokens": N, "vocab": V, "chunk": chunk, "loss_abs_err": float((lp - lc).abs()),
            "grad_h_max_rel_err": float((hp - hc).abs().max() / hp.abs().max()),
            "grad_w_max_rel_err": float((wp - wc).abs().max() / wp.abs().max()),
            "peak_gib_plain": mem_plain / GiB, "peak_gib_chunked": mem_chunked / GiB,
            "peak_gib_above_inputs_plain": (mem_plain - inputs) / GiB,
            "peak_gib_above_inputs_chunked": (mem_chunked - inputs) / GiB}


def check_planner(a, dev) -> dict:
    from spes.config.loader import load_params
    from spes.train.plan import plan_node
    from spes.train.planned_nodes import planned_nodes
    from spes.train.trainer import build_node_trainer

    p = load_params(os.path.join(ROOT, "configs", "spes-1b.yaml"))
    cfg, s = p.model, p.train
    if a.smoke:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=64, num_layers=2,
                                  num_heads=4, num_kv_heads=4, loss_chunk_tokens=32)
        s = dataclasses.replace(s, seq_len=64, autocast=None if dev.type == "cpu" else s.autocast)
    rows = []
    for micro in (1, 2):
        s2 = dataclasses.replace(p, model=cfg, train=dataclasses.replace(s, micro_batch_size=micro, batch_size=micro))
        plan = plan_node(s2, 0)
        x = torch.randint(0, cfg.vocab_size, (micro, s2.train.seq_len), device=dev)

        def run():
            torch.manual_seed(0)
            tr = build_node_trainer(s2, CausalLM(cfg).to(dev), planned_nodes(s2).owned[0])
            for step in range(2):
                tr.train_step(x, x, step)
            return tr

        tr, measured = _peak_of(run, dev)
        del tr
        rows.append({"micro_batch": micro, "planned_gib": plan["peak_bytes"] / GiB, "measured_gib": measured / GiB,
                     "planned_over_measured": plan["peak_bytes"] / measured if measured else None})
    return {"preset": "configs/spes-1b.yaml", "seq_len": s.seq_len, "cases": rows}


def check_node_round(a, dev) -> dict:
    """One node round from the same initial model and data, on the CPU and on `dev`, both fp32."""
    import glob
    import sysconfig

    from spes.data.tokenization import tokenize_corpus
    from spes.data.tokens import TokenData
    from spes.round.context import RoundContext
    from spes.round.node import NodeRound
    from spes.run.identity import InitModel, settings_fingerprint
    from spes.run.run import Run
    from spes.storage.store import Store
    from spes.sync.deltas import EXPERTS_FILE, SHARED_FILE

    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    docs = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"],
                                                                                       "json", "*.py")))]
    tokens = os.path.join(tmp, "tokens")
    tokenize_corpus(docs, tokens, 512, None, 0.2, 0)
    data = TokenData.open(tokens)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                      num_experts=4, top_k=2, max_seq_len=64)
    torch.manual_seed(0)
    init = CausalLM(cfg).canonical_state_dict()
    out = {}
    for key, where in (("reference", "cpu"), ("device", str(dev))):
        p = Params(model=cfg, train=TrainConfig(seq_len=64), merge=MergeConfig(top_k=2), dense=DenseConfig(seq_len=64),
                   eval=EvalConfig(seq_len=64))  # a Params is checked when built: sequences that fit the model
        s = p.sync
        s.num_nodes, s.every_steps, s.rounds, s.warmup_rounds, p.train.batch_size = 2, 4, 2, 0, 4
        name = key
        p.storage.url, p.orchestration.device = os.path.join(tmp, f"{name}-storage"), where
        p.orchestration.node_state_dir = os.path.join(tmp, f"{name}-nodes")
        store = Store.from_config(p.storage)
        run = Run(store, "r")
        run.ensure(settings_fingerprint(p), InitModel.from_state(init, cfg, "gpu-check"))
        t = time.perf_counter()
        report = NodeRound(RoundContext.build(p, "r", store), 1, 0, data).run()
        files = store.read_bundle(run.layout.node_dir(1, 0)).files
        out[key] = {"losses": report.upload.losses, "files": files, "seconds": time.perf_counter() - t,
                      "device": report.upload.device}
    cpu, gpu = out["reference"], out["device"]
    err = {}
    for f in (SHARED_FILE, EXPERTS_FILE):
        for k, t in cpu["files"][f].items():
            scale = t.abs().max().clamp_min(1e-12)
            err[f"{f}:{k}"] = float((gpu["files"][f][k] - t).abs().max() / scale)
    worst = max(err.values())
    loss_err = max(abs(x - y) for x, y in zip(cpu["losses"], gpu["losses"]))
    return {"device": gpu["device"], "losses_cpu": cpu["losses"], "losses_device": gpu["losses"],
            "loss_max_abs_diff": loss_err, "delta_max_rel_err": worst, "worst_tensor": max(err, key=err.get),
            "within_bf16_tolerance": loss_err < 1e-2 and worst < 2e-2,
            "seconds_cpu": cpu["seconds"], "seconds_device": gpu["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on any device: the script runs, nothing measured")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        raise SystemExit("gpu_check: no CUDA device here (torch sees none); --smoke runs it at toy sizes anyway")
    dev = torch.device("cuda" if cuda else "cpu")
    results: dict = {"date": time.strftime("%Y-%m-%d"), "smoke": a.smoke}
    t_all = time.perf_counter()
    peak = None
    checks = [("env", lambda: check_env(a, dev)), ("matmul_peak", lambda: check_matmul_peak(a, dev)),
              ("moe_step", lambda: check_moe_step(a, dev, peak)), ("grouped_gemm", lambda: check_grouped_gemm(a, dev)),
              ("chunked_loss", lambda: check_chunked_loss(a, dev)), ("planner", lambda: check_planner(a, dev)),
              ("node_round", lambda: check_node_round(a, dev))]
    for name, fn in checks:
        t = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # one check's failure is its result; the others still run
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        results[name]["seconds"] = round(time.perf_counter() - t, 1)
        if name == "matmul_peak" and "flops" in results[name]:
            peak = results[name]["flops"]
        print(f"{name}: {json.dumps(results[name])}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
