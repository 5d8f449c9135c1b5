"""The run's TensorBoard events, read back with tensorboard's own reader, hold the round records' numbers at
the run's token counts; a resume replaces the points of recomputed rounds instead of doubling them."""
import struct
import time

from spes.config.schema import Params
from spes.run.board import RunBoard, board_dir
from spes.run.records import GlobalMeta, NodeReport, RoundRecord, StateRef, UploadMeta
from spes.train.schedule import lr_at


def _f32(x: float) -> float:  # event files store scalars as float32
    return struct.unpack("f", struct.pack("f", x))[0]


def _record(r: int, losses: dict, heldout=None) -> RoundRecord:
    nodes = []
    for node, ls in losses.items():
        up = UploadMeta(round=r, node=node, experts=[node], tokens=100 * len(ls), base_round=r - 1, base_sha256="x",
                        codec="fp32", state=StateRef(r, "d", False), step_end=r * len(ls), loss_first=ls[0],
                        loss_last=ls[-1], loss_mean=sum(ls) / len(ls), losses=ls, expert_load=[[3, 1], [2, 2]],
                        ranks=1, bytes_down=1000 + node, seconds_load=0.1, seconds_compute=0.5, device="cpu",
                        grad_norms=[2.0 + node + 0.5 * i for i in range(len(ls))],
                        lb_losses=[1.0 + 0.25 * i for i in range(len(ls))], z_losses=[0.5 * node] * len(ls),
                        timeline=[[1, 0.1], [2, 0.5]])
        nodes.append(NodeReport(node, "ok", up, bytes_up=2000 + node))
    agg = GlobalMeta(round=r, step=r * 2, model_config={}, merge_alpha=0.05 * r)
    return RoundRecord(round=r, wall_s=1.5, max_node_compute_s=1.0, nodes=nodes, aggregate=agg, heldout_loss=heldout,
                       heldout_s=0.2, tokens=sum(n.tokens for n in nodes))


def _read(folder: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_the_events_hold_the_records_numbers_at_token_counts(tmp_path):
    p = Params(artifacts_dir=str(tmp_path))
    p.sync.every_steps = 2
    b = RunBoard(p, "r", 0)
    b.add(_record(1, {0: [5.0, 4.5], 1: [5.1, 4.6]}, heldout=4.9))
    b.add(_record(2, {0: [4.2, 4.0], 1: [4.3, 4.1]}))
    b.close()
    ev = _read(board_dir(p, "r"))
    # each round: 2 nodes x 2 steps x 100 tokens = 400 tokens, a step of both nodes 200
    assert ev["train/loss/node0"] == [(200, 5.0), (400, 4.5), (600, _f32(4.2)), (800, 4.0)]
    assert ev["train/loss/node1"] == [(200, _f32(5.1)), (400, _f32(4.6)), (600, _f32(4.3)), (800, _f32(4.1))]
    assert ev["train/lr"] == [(200 * (i + 1), _f32(lr_at(i, p.train.optim, p.sync.total_steps))) for i in range(4)]
    assert ev["heldout/loss"] == [(400, _f32(4.9))]  # round 2 had none
    assert ev["traffic/up_bytes/node1"] == [(400, 2001.0), (800, 2001.0)]
    assert ev["traffic/down_bytes/node0"] == [(400, 1000.0), (800, 1000.0)]
    assert ev["sync/merge_alpha"] == [(400, _f32(0.05)), (800, _f32(0.1))]
    assert ev["experts/balance/layer0"] == [(400, 1.5), (800, 1.5)]  # (6, 2) over both nodes: 6 / 4
    assert ev["train/grad_norm/node1"] == [(200, 3.0), (400, 3.5), (600, 3.0), (800, 3.5)]
    assert ev["train/tokens_per_s/node0"] == [(400, 400.0), (800, 400.0)]  # 200 tokens in 0.5 s
    assert ev["train/lb_loss/node0"] == [(200, 1.0), (400, 1.25), (600, 1.0), (800, 1.25)]
    assert ev["train/z_loss/node1"] == [(200, 0.5), (400, 0.5), (600, 0.5), (800, 0.5)]
    # progress lines after step 1 (0.1 s) and step 2 (0.5 s), 100 tokens a step: 1000 then 250 tokens/s
    assert ev["train/tokens_per_s_within/node0"] == [(200, 1000.0), (400, 250.0), (600, 1000.0), (800, 250.0)]
    assert ev["experts/load/layer1/expert00/node0"] == [(400, 2.0), (800, 2.0)]
    assert ev["experts/load/layer0/expert00/node1"] == [(400, 3.0), (800, 3.0)]


def test_a_resume_replaces_the_recomputed_rounds_points(tmp_path):
    p = Params(artifacts_dir=str(tmp_path))
    p.sync.every_steps = 2
    b = RunBoard(p, "r", 0)
    b.add(_record(1, {0: [5.0, 4.5]}, heldout=4.9))
    b.add(_record(2, {0: [4.2, 4.0]}, heldout=4.1))
    b.close()
    # a resume is a later process: its event file's name has a later second. Within one second TensorBoard
    # orders two files of one process by a writer counter compared as text ("10" before "9")
    time.sleep(1.1)
    b = RunBoard(p, "r", 200)  # resumed after round 1 (200 tokens): round 2 recomputed, differently
    b.add(_record(2, {0: [4.25, 4.05]}, heldout=4.15))
    b.close()
    ev = _read(board_dir(p, "r"))
    assert ev["heldout/loss"] == [(200, _f32(4.9)), (400, _f32(4.15))]
    assert ev["train/loss/node0"] == [(100, 5.0), (200, 4.5), (300, _f32(4.25)), (400, _f32(4.05))]


def test_off_when_no_folder_is_set():
    p = Params()
    p.orchestration.tensorboard_dir = None
    assert board_dir(p, "r") is None
