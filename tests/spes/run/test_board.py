"""The run's TensorBoard events, read back with tensorboard's own reader, hold the round records' numbers at
the global optimizer steps, a TensorBoard run per node; a resume replaces the points of recomputed rounds
instead of doubling them."""
import os
import struct
import time

from spes.config.schema import Params
from spes.run.board import RunBoard, board_dir, load_heat_map
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

    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _images(folder: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"images": 0})
    acc.Reload()
    return {tag: [(e.step, e.width, e.height, e.encoded_image_string) for e in acc.Images(tag)]
            for tag in acc.Tags()["images"]}


def test_the_events_hold_the_records_numbers_at_global_steps(tmp_path):
    p = Params(artifacts_dir=str(tmp_path))
    p.sync.every_steps = 2
    b = RunBoard(p, "r", [])
    b.add(_record(1, {0: [5.0, 4.5], 1: [5.1, 4.6]}, heldout=4.9))
    b.add(_record(2, {0: [4.2, 4.0], 1: [4.3, 4.1]}))
    b.close()
    # one TensorBoard run per node and one for the run's global curves, so the nodes overlay on one chart
    assert sorted(os.listdir(board_dir(p, "r"))) == ["global", "node0", "node1"]
    node0, node1, glob = (_read(os.path.join(board_dir(p, "r"), d)) for d in ("node0", "node1", "global"))
    # x: the global optimizer step; each round: 2 nodes x 2 steps x 100 tokens = 400 tokens, a step 200
    assert node0["loss/train"] == [(1, 5.0), (2, 4.5), (3, _f32(4.2)), (4, 4.0)]
    assert node1["loss/train"] == [(1, _f32(5.1)), (2, _f32(4.6)), (3, _f32(4.3)), (4, _f32(4.1))]
    assert glob["tokens/train"] == [(1, 200.0), (2, 400.0), (3, 600.0), (4, 800.0)]
    assert glob["optim/lr"] == [(i + 1, _f32(lr_at(i, p.train.optim, p.sync.total_steps))) for i in range(4)]
    assert glob["loss/heldout"] == [(2, _f32(4.9))]  # round 2 had none
    assert node1["traffic/up_bytes"] == [(2, 2001.0), (4, 2001.0)]
    assert node0["traffic/down_bytes"] == [(2, 1000.0), (4, 1000.0)]
    assert glob["round/merge_alpha"] == [(2, _f32(0.05)), (4, _f32(0.1))]
    assert glob["routing/balance_layer0"] == [(2, 1.5), (4, 1.5)]  # (6, 2) over both nodes: 6 / 4
    assert node1["optim/grad_norm"] == [(1, 3.0), (2, 3.5), (3, 3.0), (4, 3.5)]
    assert node0["speed/tokens_per_s"] == [(2, 400.0), (4, 400.0)]  # 200 tokens in 0.5 s
    assert node0["routing/lb_loss"] == [(1, 1.0), (2, 1.25), (3, 1.0), (4, 1.25)]
    assert node1["routing/z_loss"] == [(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.5)]
    # progress lines after step 1 (0.1 s) and step 2 (0.5 s), 100 tokens a step: 1000 then 250 tokens/s
    assert node0["speed/tokens_per_s_within"] == [(1, 1000.0), (2, 250.0), (3, 1000.0), (4, 250.0)]
    # the expert load: one heat map per layer, redrawn each round over every round so far
    images = _images(os.path.join(board_dir(p, "r"), "global"))
    assert sorted(images) == ["routing/expert_load_layer0", "routing/expert_load_layer1"]
    assert [(step, w, h) for step, w, h, _ in images["routing/expert_load_layer0"]] == [(2, 600, 24), (4, 600, 24)]


def test_the_heat_map_colours_each_experts_share_over_the_mean():
    import torch

    img = load_heat_map([[5, 3], [2, 2], [0, 4]], cell_h=2, width=6)  # 3 rounds of 2 experts
    assert img.shape == (3, 4, 6) and img.dtype == torch.uint8
    # shares over the mean: round 1 (1.25, 0.75), round 2 (1, 1), round 3 (0, 2); a 2 x 2 cell each, colours
    # interpolated between the stops (half to even: 63.5 -> 64, 113.5 -> 114, 139.5 -> 140)
    assert img[:, 0, 0].tolist() == [64, 173, 119]  # 1.25: halfway from teal (1) to green (1.5)
    assert img[:, 2, 0].tolist() == [46, 114, 140]  # 0.75: halfway from blue (0.5) to teal
    assert img[:, 0, 2].tolist() == img[:, 2, 2].tolist() == [33, 145, 140]  # balanced
    assert img[:, 0, 4].tolist() == [68, 1, 84] and img[:, 2, 4].tolist() == [253, 231, 37]  # unused, twice the mean
    assert torch.equal(img[:, 0:2, 0:2], img[:, 0:1, 0:1].expand(3, 2, 2))  # each cell a block of one colour


def test_a_resume_replaces_the_recomputed_rounds_points(tmp_path):
    p = Params(artifacts_dir=str(tmp_path))
    p.sync.every_steps = 2
    b = RunBoard(p, "r", [])
    first = _record(1, {0: [5.0, 4.5]}, heldout=4.9)
    b.add(first)
    b.add(_record(2, {0: [4.2, 4.0]}, heldout=4.1))
    b.close()
    # a resume is a later process: its event file's name has a later second. Within one second TensorBoard
    # orders two files of one process by a writer counter compared as text ("10" before "9")
    time.sleep(1.1)
    b = RunBoard(p, "r", [first])  # resumed after round 1: round 2 recomputed, differently
    b.add(_record(2, {0: [4.25, 4.05]}, heldout=4.15))
    b.close()
    glob, node0 = (_read(os.path.join(board_dir(p, "r"), d)) for d in ("global", "node0"))
    assert glob["loss/heldout"] == [(2, _f32(4.9)), (4, _f32(4.15))]
    assert node0["loss/train"] == [(1, 5.0), (2, 4.5), (3, _f32(4.25)), (4, _f32(4.05))]
    assert glob["tokens/train"] == [(1, 100.0), (2, 200.0), (3, 300.0), (4, 400.0)]  # continued from round 1's
    # the heat map after the resume still has both rounds' columns (round 1's from its record)
    images = _images(os.path.join(board_dir(p, "r"), "global"))["routing/expert_load_layer0"]
    assert [(step, w) for step, w, _, _ in images] == [(2, 600), (4, 600)]


def test_off_when_no_folder_is_set():
    p = Params()
    p.orchestration.tensorboard_dir = None
    assert board_dir(p, "r") is None
