"""The memory planner (spes/train/plan.py) against measured peaks, side by side in one run.

Each case trains a SPES node (own experts trainable, the rest frozen) for a few steps in a fresh process
and measures its peak: CUDA's max_memory_allocated on a GPU, else the process's resident-set high-water
mark above what it held before building the model (torch imported and warmed up on a tiny model, data
made; glibc's mmap threshold fixed so that freed memory leaves the resident set). Cases vary the model, the
micro-batch, activation checkpointing, the loss (plain with the LM-head z-loss, chunked) and the node's
ranks: 2 ranks (a torchrun job, gloo on the CPU) with the model replicated (ddp) or sharded (fsdp; built on
the meta device, so no rank ever holds the whole model), the peak of the larger rank. fp32 on the CPU,
bf16 autocast where a GPU is present.

    python bench/memory_plan.py [--json]
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cleanup import exit_on_termination  # noqa: E402
from spes.config.loader import to_dict  # noqa: E402
from spes.config.schema import ModelConfig, OrchestrationConfig, Params, SyncConfig, TrainConfig  # noqa: E402
from spes.train.plan import plan_node  # noqa: E402

MOE_S = dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=8, num_experts=8, top_k=2,
             vocab_size=8192)
MOE_M = dict(hidden_size=384, intermediate_size=768, num_layers=6, num_heads=6, num_kv_heads=2, num_experts=16, top_k=2,
             vocab_size=16384, qk_norm="head")
CHUNKED = dict(loss_impl="chunked", loss_chunk_tokens=256)
Z = dict(lm_head_z_loss_coef=1e-5)
# name, model, micro-batch, checkpointing, ranks, node_parallel
CASES = [
    ("moe-s", MOE_S, 8, "none", 1, "ddp"),
    ("moe-s-ckpt", MOE_S, 8, "block", 1, "ddp"),
    ("moe-m", MOE_M, 4, "none", 1, "ddp"),
    ("moe-m-ckpt", MOE_M, 4, "block", 1, "ddp"),
    ("moe-m-zloss", {**MOE_M, **Z}, 4, "none", 1, "ddp"),
    ("moe-m-chunked", {**MOE_M, **Z, **CHUNKED}, 4, "none", 1, "ddp"),
    ("moe-m-ddp2", {**MOE_M, **CHUNKED}, 4, "none", 2, "ddp"),
    ("moe-m-fsdp2", {**MOE_M, **CHUNKED}, 4, "none", 2, "fsdp"),
]
SEQ, NODES, STEPS = 512, 4, 3

CHILD = """
import dataclasses, json, os, sys, torch
sys.path.insert(0, {root!r})
from spes.config.loader import params_from_dict
from spes.train.planned_nodes import planned_nodes
from spes.train.trainer import build_node_trainer
from spes.model.transformer import CausalLM
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key): return int(line.split()[1]) * 1024
ranks = int(os.environ.get('WORLD_SIZE', '1'))
if ranks > 1:
    import torch.distributed as dist
    dist.init_process_group('gloo')
rank = int(os.environ.get('RANK', '0'))
p = params_from_dict(json.loads({params!r}))
cfg, s = p.model, p.train
cuda = torch.cuda.is_available()
dev = torch.device('cuda', int(os.environ.get('LOCAL_RANK', '0'))) if cuda else torch.device('cpu')
torch.manual_seed(0)
x = torch.randint(0, cfg.vocab_size, (s.batch_size, s.seq_len))
share = slice(rank * s.batch_size // ranks, (rank + 1) * s.batch_size // ranks)
torch.set_num_threads(2)
warm = dataclasses.replace(cfg, num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=2,
                           vocab_size=64)  # thread pools etc. before measuring
w = build_node_trainer(p, CausalLM(warm).to(dev), planned_nodes(p).owned[0])
w.train_step(x[share, :16] % 64, x[share, :16] % 64, 0)
del w
if cuda:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
else:
    open('/proc/self/clear_refs', 'w').write('5')
    base = status('VmRSS')
if s.node_parallel == 'fsdp' and ranks > 1:
    with torch.device('meta'):
        model = CausalLM(cfg)
    tr = build_node_trainer(p, model, planned_nodes(p).owned[0], dev)
    for w in model.parameters():  # values do not matter here, only that they are finite
        torch.nn.init.normal_(w.to_local(), std=0.02)
else:
    tr = build_node_trainer(p, CausalLM(cfg).to(dev), planned_nodes(p).owned[0])
for step in range({steps}):
    tr.train_step(x[share], x[share], step)
peak = torch.cuda.max_memory_allocated() - base if cuda else status('VmHWM') - base
if ranks > 1:
    t = torch.tensor([peak])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    peak = int(t.item())
if rank == 0:
    print(json.dumps({{"peak": peak, "device": str(dev)}}))
if ranks > 1:
    dist.destroy_process_group()
"""


def measure(p: Params) -> dict:
    ranks = p.orchestration.gpus_per_node
    code = CHILD.format(root=ROOT, params=json.dumps(to_dict(p)), steps=STEPS)
    # glibc keeps freed heap memory resident and raises its mmap threshold as it goes: a fixed threshold
    # makes the resident set follow what torch really holds
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    if ranks == 1:
        cmd = [sys.executable, "-c", code]
    else:
        folder = tempfile.mkdtemp(prefix="memory-plan-")
        atexit.register(shutil.rmtree, folder, True)
        path = os.path.join(folder, "child.py")
        with open(path, "w") as f:
            f.write(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", path]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    exit_on_termination()  # a kill still removes the ranks' child script (atexit)
    import torch

    rows = []
    for name, cfg, micro, ckpt, ranks, parallel in CASES:
        s = TrainConfig(batch_size=8, micro_batch_size=min(micro, 8 // ranks), seq_len=SEQ, activation_checkpointing=ckpt,
                        autocast="bfloat16" if torch.cuda.is_available() else None, node_parallel=parallel)
        p = Params(model=ModelConfig(**{**cfg, "max_seq_len": SEQ}), sync=SyncConfig(num_nodes=NODES), train=s,
                   orchestration=OrchestrationConfig(gpus_per_node=ranks))
        plan = plan_node(p, 0, ranks)
        got = measure(p)
        rows.append({"case": name, "micro_batch": s.micro_batch_size, "checkpointing": ckpt, "ranks": ranks,
                     "parallel": plan["parallel"], "planned": plan["peak_bytes"], "measured": got["peak"],
                     "ratio": plan["peak_bytes"] / got["peak"], "device": got["device"]})
    print(f"{'case':14} {'micro':>5} {'ckpt':>6} {'ranks':>5} {'planned MiB':>12} {'measured MiB':>13} "
          f"{'planned/measured':>17}")
    for r in rows:
        print(f"{r['case']:14} {r['micro_batch']:5d} {r['checkpointing']:>6} {r['ranks']:5d} {r['planned'] / 2**20:12.1f} "
              f"{r['measured'] / 2**20:13.1f} {r['ratio']:17.3f}")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"worst deviation {worst:.1%} (goal: within 15%), measured on {rows[0]['device']}")
    if a.json:
        print(json.dumps({"cases": rows, "worst_deviation": worst}))


if __name__ == "__main__":
    main()
