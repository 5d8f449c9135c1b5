"""What crosses the link per node per round, and what aggregation costs, measured side by side in one run.

Real node rounds (spes.round.node: fetch the global, one local step, encode, upload) and real aggregation
(spes.round.aggregator) on a local folder, for SPES with each codec and for DiLoCo (fp32, and int8 as
INTELLECT-1 sends), on one MoE (16 experts, 4 nodes by default). Per node per round in steady state
(round 2: nodes rebuild global 1 from delta 1), counting every byte a node reads or writes on shared
storage (manifests and commit markers included):

  ratio_vs_diloco_fp32 = (bytes up + bytes down) / (2 x the fp32 model's bytes)

Also: aggregation (fp32 SPES, round 2) vs a raw copy of the same bytes on the same disk (read the round's
inputs: global 1 and the uploads; write as many bytes as the aggregator writes), as a throughput ratio,
best of --repeats, cold (global 1 read from storage, as in a flow's first round) and warm (global 1 held
from the previous round, as in every later one); the aggregator's peak memory (resident-set growth in a
fresh process, vs the model's bytes); node state bytes at a checkpoint round; and storage growth per
round with retention (keep_rounds=2) against what keeping every round would store.

    python bench/sync_round.py [--nodes 4] [--hidden 256] [--layers 4] [--experts 16] [--json]

The default finishes in minutes on 2 cores; the README's table was measured at --hidden 384 --layers 8 (67.7M).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cleanup import exit_on_termination  # noqa: E402
from spes.config.schema import MergeConfig, ModelConfig, Params  # noqa: E402
from spes.data.shards import ShardWriter  # noqa: E402
from spes.data.tokens import TokenData, write_index  # noqa: E402
from spes.model.transformer import CausalLM  # noqa: E402
from spes.round.aggregator import Aggregator  # noqa: E402
from spes.round.context import RoundContext
from spes.round.driver import run_round  # noqa: E402
from spes.round.node import NodeRound  # noqa: E402
from spes.run.identity import InitModel, settings_fingerprint  # noqa: E402
from spes.run.layout import MODEL_FILE  # noqa: E402
from spes.run.run import Run  # noqa: E402
from spes.storage.store import Store  # noqa: E402

VARIANTS = [("spes", "fp32"), ("spes", "bf16"), ("spes", "int8"), ("diloco", "fp32"), ("diloco", "int8")]


def synthetic_tokens(folder: str, vocab: int) -> TokenData:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    shards = {}
    for split, n in (("train", 200_000), ("val", 20_000)):
        w = ShardWriter(folder, split, np.uint16, n)
        w.add(rng.integers(0, vocab, n, dtype=np.uint16), np.array([n]))
        shards[split] = w.finish()
    write_index(folder, shards, np.uint16, vocab, vocab, 0)
    return TokenData.open(folder)


def make_params(a, root: str, method: str, codec: str) -> Params:
    cfg = ModelConfig(vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.hidden, num_layers=a.layers,
                      num_heads=8, num_kv_heads=8, num_experts=a.experts, top_k=2, max_seq_len=128)
    p = Params(model=cfg, merge=MergeConfig(enabled=False))  # steady state: no merging round
    s = p.sync
    s.method, s.num_nodes, s.every_steps, s.rounds, p.train.batch_size, p.train.seq_len = method, a.nodes, 1, 10, 1, 32
    p.sync.codec = codec
    p.storage.url, p.storage.keep_rounds = os.path.join(root, f"{method}-{codec}"), 2
    p.orchestration.device, p.orchestration.node_state_dir = "cpu", os.path.join(root, f"nodes-{method}-{codec}")
    return p


def run_variant(a, root: str, data: TokenData, method: str, codec: str, after_round_2=None, rounds: int = 3) -> dict:
    p = make_params(a, root, method, codec)
    store = Store.from_config(p.storage)
    run = Run(store, "bench")
    torch.manual_seed(0)
    run.ensure(settings_fingerprint(p), InitModel.from_state(CausalLM(p.model).canonical_state_dict(), p.model, "bench"))
    model_bytes = store.read_manifest(run.layout.global_dir(0))["files"][MODEL_FILE]["bytes"]
    rows, extra, size, written = {}, {}, {}, {}
    flow = RoundContext.build(p, "bench", store, writer=True)  # the flow's: the driver and the aggregator share it
    agg = Aggregator(flow)
    for r in range(1, rounds + 1):
        w0 = store.bytes_written
        def run_nodes(nodes, checkpoint, r=r):  # each node with a context of its own, as a node process
            return {i: NodeRound(RoundContext.build(p, "bench", store), r, i, data, checkpoint=checkpoint).run() for i in nodes}

        # the real round (spes/round/driver.py): nodes, aggregation, record, retention; no held-out probe
        rec = run_round(flow, r, run_nodes, lambda rerun, r=r: agg.aggregate(r, rerun_rejected=rerun),
                        checkpoint=(r % 3 == 0))
        rows[r] = rec.nodes
        written[r] = store.bytes_written - w0
        if r == 2 and after_round_2 is not None:
            extra = after_round_2(p, store)
        size[r] = store.size_of(run.layout.base)
    steady = rows[2]
    if rounds >= 6:  # rounds 4-6: one checkpoint round, like rounds 1-3
        extra["storage_growth_per_round"] = (size[6] - size[3]) / 3
        extra["stored_per_round_keep_all"] = sum(written[r] for r in (4, 5, 6)) / 3
    up = sum(m.bytes_up for m in steady) / len(steady)
    down = sum(m.bytes_down for m in steady) / len(steady)
    ckpt = sum(m.bytes_up for m in rows[3]) / a.nodes - up
    return {"bytes_up_per_node": up, "bytes_down_per_node": down, "ratio_vs_diloco_fp32": (up + down) / (2 * model_bytes),
            "checkpoint_bytes_per_node": ckpt, "model_bytes": model_bytes,
            "storage_bytes": size[rounds], **extra}


def time_aggregation(p: Params, store: Store, repeats: int, warm: bool) -> tuple[float, float, int, int]:
    """Best-of times of aggregate_round (round 2, recomputed) and of a raw copy of the same bytes."""
    layout = Run(store, "bench").layout
    t_agg, t_raw = [], []
    for _ in range(repeats):
        # recompute global 2 from the same committed uploads (set its commits aside, restore after)
        for rel in (layout.global_dir(2), layout.delta_dir(2)):
            store.move(rel, rel + ".saved")
        aggregator = Aggregator(RoundContext.build(p, "bench", store))
        if warm:
            aggregator.hold(1)  # untimed: what the flow holds after committing round 1
        r0, w0 = store.bytes_read, store.bytes_written
        t0 = time.perf_counter()
        aggregator.aggregate(2)
        t_agg.append(time.perf_counter() - t0)
        read, written = store.bytes_read - r0, store.bytes_written - w0
        inputs = [store.path(layout.global_dir(1), MODEL_FILE)] + [
            store.path(layout.node_dir(2, i), f) for i in range(p.sync.num_nodes)
            for f in store.read_manifest(layout.node_dir(2, i))["files"]]
        t0 = time.perf_counter()
        blobs = []
        for f in inputs:
            with open(f, "rb") as fh:
                blobs.append(fh.read())
        with open(store.path("rawcopy.bin"), "wb") as out:
            left = written
            while left > 0:
                for b in blobs:
                    out.write(b[:left])
                    left -= min(left, len(b))
        t_raw.append(time.perf_counter() - t0)
        for rel in (layout.global_dir(2), layout.delta_dir(2)):
            store.remove(rel)
            store.move(rel + ".saved", rel)
    return min(t_agg), min(t_raw), read, written


PEAK_SNIPPET = """
import json, sys
sys.path.insert(0, {root!r})
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.config.loader import params_from_dict
from spes.storage.store import Store
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
p = params_from_dict(json.loads({params!r}))
store = Store.from_config(p.storage)
layout = 'runs/bench/rounds/000002'
for rel in (layout + '/global', layout + '/delta'):
    store.move(rel, rel + '.peak')
open('/proc/self/clear_refs', 'w').write('5')  # reset the high-water mark to the current RSS
before = status('VmRSS')
aggregate_round(RoundContext.build(p, 'bench', store), 2)
print(status('VmHWM') - before)
for rel in (layout + '/global', layout + '/delta'):
    store.remove(rel)
    store.move(rel + '.peak', rel)
"""


def peak_aggregate_bytes(p: Params) -> int:
    from spes.config.loader import to_dict

    code = PEAK_SNIPPET.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               params=json.dumps(to_dict(p)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"peak-memory probe failed: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    exit_on_termination()  # a kill still runs the finally below
    root = tempfile.mkdtemp(prefix="spes-bench-")
    try:
        data = synthetic_tokens(os.path.join(root, "tokens"), 8192)
        def measure(p, store):
            out = {"peak": peak_aggregate_bytes(p)}
            for kind in ("cold", "warm"):
                t_agg, t_raw, read, written = time_aggregation(p, store, a.repeats, kind == "warm")
                out[kind] = {"t_agg": t_agg, "t_raw": t_raw, "read": read, "written": written}
            return out

        results = {f"{m}-{c}": run_variant(a, root, data, m, c, *((measure, 6) if (m, c) == ("spes", "fp32") else ()))
                   for m, c in VARIANTS}
        ref = results["spes-fp32"]
        peak = ref["peak"]
        mb = ref["model_bytes"]
        print(f"model {mb / 2**20:.1f} MiB fp32 ({a.experts} experts, {a.nodes} nodes); per node per round, "
              f"steady state, every byte on shared storage:")
        print(f"{'variant':14} {'up MiB':>8} {'down MiB':>9} {'ratio vs DiLoCo fp32':>21} {'ckpt MiB':>9}")
        for name, res in results.items():
            print(f"{name:14} {res['bytes_up_per_node'] / 2**20:8.2f} {res['bytes_down_per_node'] / 2**20:9.2f} "
                  f"{res['ratio_vs_diloco_fp32']:21.3f} {res['checkpoint_bytes_per_node'] / 2**20:9.2f}")
        for kind in ("cold", "warm"):
            m = ref[kind]
            print(f"aggregate_round, {kind}: {m['t_agg'] * 1e3:.0f} ms (read {m['read'] / 2**20:.0f} MiB, wrote "
                  f"{m['written'] / 2**20:.0f} MiB) vs raw copy of the round's inputs and outputs {m['t_raw'] * 1e3:.0f} "
                  f"ms: throughput {m['t_raw'] / m['t_agg']:.2f}x of the copy, best of {a.repeats}")
        print(f"aggregator peak memory (cold, fresh process) {peak / 2**20:.0f} MiB = {peak / mb:.2f}x the model "
              "(incl. the new global it keeps for the next round)")
        grow, keep_all = ref["storage_growth_per_round"], ref["stored_per_round_keep_all"]
        print(f"storage per round, rounds 4-6 (one checkpoint round): {grow / 2**20:.0f} MiB with keep_rounds=2, vs "
              f"{keep_all / 2**20:.0f} MiB written (kept if every round were kept); after 6 rounds "
              f"{ref['storage_bytes'] / 2**20:.0f} MiB = {ref['storage_bytes'] / mb:.1f}x the model")
        if a.json:
            print(json.dumps({
                "codecs": {name: {k: res[k] for k in ("bytes_up_per_node", "bytes_down_per_node", "ratio_vs_diloco_fp32",
                                                     "checkpoint_bytes_per_node")} for name, res in results.items()},
                "aggregate_vs_copy": ref["warm"]["t_raw"] / ref["warm"]["t_agg"],
                "aggregate_vs_copy_cold": ref["cold"]["t_raw"] / ref["cold"]["t_agg"],
                "peak_aggregate_bytes": peak, "model_bytes": mb, "storage_bytes_per_round": grow,
                "stored_bytes_per_round_keep_all": keep_all}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
