"""One SPES sync on shared storage, measured side by side in one run (CPU, local folder):

  bytes up per node vs a full-model sync, and bytes down;
  aggregate_round (read + sha256-verify + average + take owners' experts + write + commit)
  vs a raw copy of the same bytes (read every input file, write the output once).

    python bench/sync_round.py [--nodes 4] [--hidden 384] [--layers 8] [--experts 16]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spes.config import ModelConfig, Params  # noqa: E402
from spes.model import CausalLM  # noqa: E402
from spes.ownership import ownership_for  # noqa: E402
from spes.rounds import MODEL_FILE, OPTIM_FILE, UPLOAD_FILE, aggregate_round, commit_initial  # noqa: E402
from spes.store import Store  # noqa: E402
from spes.trainer import NodeTrainer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = ModelConfig(vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.hidden, num_layers=a.layers,
                      num_heads=8, num_kv_heads=8, num_experts=a.experts, top_k=2, max_seq_len=256)
    p = Params(model=cfg)
    p.spes.num_nodes, p.spes.merge.enabled = a.nodes, False
    root = tempfile.mkdtemp(prefix="spes-bench-")
    try:
        store = Store(root)
        torch.manual_seed(0)
        model = CausalLM(cfg)
        own = ownership_for("spes", cfg.num_experts, a.nodes, None)
        t_agg, t_raw = [], []
        for rep in range(a.repeats):
            run = f"r{rep}"
            commit_initial(store, run, model, "bench")
            for i in range(a.nodes):  # node uploads: the owners' experts + shared params, slightly changed
                tr = NodeTrainer(CausalLM(cfg), own.owned(i), p.spes.optim, 10)
                tr.model.load_canonical_state_dict(model.canonical_state_dict())
                up = {k: v + 1e-3 for k, v in tr.upload().items()}
                store.write_bundle(store.node_dir(run, 1, i), {UPLOAD_FILE: up, OPTIM_FILE: {}},
                                   {"experts": list(own.owned(i)), "tokens": 1000, "loss_mean": 1.0})
            t0 = time.perf_counter()
            aggregate_round(p, store, run, 1)
            t_agg.append(time.perf_counter() - t0)
            inputs = [os.path.join(root, store.global_dir(run, 0), MODEL_FILE)]
            inputs += [os.path.join(root, store.node_dir(run, 1, i), UPLOAD_FILE) for i in range(a.nodes)]
            out = os.path.join(root, f"raw-{rep}.bin")
            t0 = time.perf_counter()
            for f in inputs:
                with open(f, "rb") as fh:
                    fh.read()
            shutil.copyfile(inputs[0], out)  # the output is one full model
            t_raw.append(time.perf_counter() - t0)
        full = store.read_manifest(store.global_dir("r0", 1))["files"][MODEL_FILE]["bytes"]
        up = [store.read_manifest(store.node_dir("r0", 1, i))["files"][UPLOAD_FILE]["bytes"] for i in range(a.nodes)]
        agg, raw = min(t_agg), min(t_raw)
        moved = full * 2 + sum(up)
        print(f"model {sum(v.numel() for v in model.canonical_state_dict().values()) / 1e6:.1f}M params, "
              f"{a.nodes} nodes, {cfg.num_experts} experts")
        print(f"bytes up per node {up[0] / 2**20:.1f} MiB vs full-model sync {full / 2**20:.1f} MiB = "
              f"{up[0] / full:.2f}x; bytes down {full / 2**20:.1f} MiB (the whole global model)")
        print(f"aggregate_round {agg * 1e3:.0f} ms vs raw copy of the same bytes {raw * 1e3:.0f} ms = "
              f"{agg / raw:.2f}x time ({moved / agg / 2**20:.0f} MiB/s vs {moved / raw / 2**20:.0f} MiB/s), "
              f"best of {a.repeats}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
