"""The memory planner (spes/train/plan.py) against measured peaks, side by side in one run.

Each case trains a SPES node (own experts trainable, the rest frozen) for a few steps in a fresh process
and measures its peak: CUDA's max_memory_allocated on a GPU, else the process's resident-set high-water
mark above what it held before building the model (torch imported and warmed up on a tiny model, data
made; glibc's mmap threshold fixed so that freed memory leaves the resident set). Cases vary the model, the
micro-batch and activation checkpointing; fp32 on the CPU, bf16 autocast where a GPU is present.

    python bench/memory_plan.py [--json]
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from spes.config.schema import ModelConfig, SpesConfig  # noqa: E402
from spes.train.plan import plan_node  # noqa: E402

CASES = [
    ("moe-s", dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=8, num_experts=8,
                   top_k=2, vocab_size=8192), 8, "none"),
    ("moe-s-ckpt", dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=8,
                        num_experts=8, top_k=2, vocab_size=8192), 8, "block"),
    ("moe-m", dict(hidden_size=384, intermediate_size=768, num_layers=6, num_heads=6, num_kv_heads=2, num_experts=16,
                   top_k=2, vocab_size=16384, qk_norm="head"), 4, "none"),
    ("moe-m-ckpt", dict(hidden_size=384, intermediate_size=768, num_layers=6, num_heads=6, num_kv_heads=2,
                        num_experts=16, top_k=2, vocab_size=16384, qk_norm="head"), 4, "block"),
]
SEQ, NODES, STEPS = 512, 4, 3

CHILD = """
import json, sys, torch
sys.path.insert(0, {root!r})
from spes.config.schema import ModelConfig, SpesConfig
from spes.train.trainer import build_node_trainer
from spes.model.transformer import CausalLM
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'): return int(line.split()[1]) * 1024
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'): return int(line.split()[1]) * 1024
cfg = ModelConfig(**json.loads({cfg!r}))
s = SpesConfig(**json.loads({spes!r}))
cuda = torch.cuda.is_available()
dev = torch.device('cuda' if cuda else 'cpu')
torch.manual_seed(0)
x = torch.randint(0, cfg.vocab_size, (s.batch_size, s.seq_len))
torch.set_num_threads(2)
warm = ModelConfig(**{{**json.loads({cfg!r}), "num_layers": 1, "hidden_size": 64, "intermediate_size": 64,
                      "num_heads": 2, "num_kv_heads": 2, "vocab_size": 64}})  # thread pools etc. before measuring
w = build_node_trainer(s, CausalLM(warm).to(dev), 0)
w.train_step(x[:, :16] % 64, x[:, :16] % 64, 0)
del w
if cuda:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
else:
    open('/proc/self/clear_refs', 'w').write('5')
    base = rss()
model = CausalLM(cfg).to(dev)
tr = build_node_trainer(s, model, 0)
for step in range({steps}):
    tr.train_step(x, x, step)
peak = torch.cuda.max_memory_allocated() - base if cuda else hwm() - base
print(json.dumps({{"peak": peak, "device": str(dev)}}))
"""


def measure(cfg: dict, s: SpesConfig) -> dict:
    spes = {k: v for k, v in s.__dict__.items() if k in ("method", "num_nodes", "batch_size", "micro_batch_size", "seq_len",
                                                         "activation_checkpointing", "autocast", "frozen_dtype")}
    code = CHILD.format(root=ROOT, cfg=json.dumps(cfg), spes=json.dumps(spes), steps=STEPS)
    # glibc keeps freed heap memory resident and raises its mmap threshold as it goes: a fixed threshold
    # makes the resident set follow what torch really holds
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import torch

    rows = []
    for name, cfg, micro, ckpt in CASES:
        s = SpesConfig(num_nodes=NODES, batch_size=8, micro_batch_size=micro, seq_len=SEQ, activation_checkpointing=ckpt,
                       autocast="bfloat16" if torch.cuda.is_available() else None)
        plan = plan_node(ModelConfig(**{**cfg, "max_seq_len": SEQ}), s, 0)
        got = measure({**cfg, "max_seq_len": SEQ}, s)
        rows.append({"case": name, "micro_batch": micro, "checkpointing": ckpt, "planned": plan["peak_bytes"],
                     "measured": got["peak"], "ratio": plan["peak_bytes"] / got["peak"], "device": got["device"]})
    print(f"{'case':12} {'micro':>5} {'ckpt':>6} {'planned MiB':>12} {'measured MiB':>13} {'planned/measured':>17}")
    for r in rows:
        print(f"{r['case']:12} {r['micro_batch']:5d} {r['checkpointing']:>6} {r['planned'] / 2**20:12.1f} "
              f"{r['measured'] / 2**20:13.1f} {r['ratio']:17.3f}")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"worst deviation {worst:.1%} (goal: within 15%), measured on {rows[0]['device']}")
    if a.json:
        print(json.dumps({"cases": rows, "worst_deviation": worst}))


if __name__ == "__main__":
    main()
