"""A sync method's node-side hook (spes/sync/method.py: LocalStepHook, SyncMethod.node_hooks): the local steps
run it after the steps it names, on the node's live trained parameters, and what it does is in the upload;
a node the method gives no hook trains exactly as without one."""
import dataclasses

import pytest
import torch

from spes.data.tokens import TokenData
from spes.round.context import RoundContext
from spes.round.node import NodeRound
from spes.sync.deltas import SHARED_FILE
from spes.sync.method import LocalStepHook
from spes.sync.methods import Spes
from tests.spes.round.test_round import make_params, start

NAME = "model.norm.weight"


@pytest.fixture
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


class SetAt(LocalStepHook):
    """Sets one parameter to `value` after local step `step`, noting every step it is asked about."""

    def __init__(self, step: int, value: float):
        self.step, self.value, self.asked, self.ran = step, value, [], []

    def wants(self, step: int) -> bool:
        self.asked.append(step)
        return step == self.step

    def __call__(self, step: int, params: dict) -> None:
        assert not torch.is_grad_enabled()
        self.ran.append(step)
        params[NAME].fill_(self.value)


class Hooked(Spes):
    def __init__(self, p, hooks: dict):
        super().__init__(p)
        self.hooks = hooks

    def node_hooks(self, r: int, node: int) -> list[LocalStepHook]:
        return [self.hooks[node]] if node in self.hooks else []


def _round_one(tmp_path, data, name, hooks=None):
    """Round 1 of both nodes; their decoded shared deltas (fp32: exact) and global 0."""
    p = make_params(tmp_path, name=name, codec="fp32")
    run = start(p)
    ctx = RoundContext.build(p, "r", run.store)
    if hooks is not None:
        ctx = dataclasses.replace(ctx, method=Hooked(p, hooks))
    for node in (0, 1):
        NodeRound(ctx, 1, node, data).run()
    ups = {i: run.store.read_bundle(run.layout.node_dir(1, i)).files[SHARED_FILE] for i in (0, 1)}
    return ups, run.store.read_bundle(run.layout.global_dir(0)).files["model.safetensors"]


def test_a_hook_runs_after_the_steps_it_names_and_its_change_is_in_the_upload(tmp_path, data):
    last = SetAt(step=1, value=0.5)  # every_steps 2: after the round's last step
    plain, g0 = _round_one(tmp_path, data, "plain")
    hooked, _ = _round_one(tmp_path, data, "hooked", {0: last})
    assert last.asked == [0, 1] and last.ran == [1]
    delta = {k: v for k, v in hooked[0].items() if k.startswith(NAME)}
    assert len(delta) == 1
    (key, value), = delta.items()
    assert torch.equal(value, torch.full_like(g0[NAME], 0.5) - g0[NAME])  # the upload: 0.5 - start, exactly
    assert not torch.equal(value, plain[0][key])
    assert all(torch.equal(hooked[1][k], plain[1][k]) for k in plain[1])  # node 1 has no hook: bit for bit


def test_a_hook_mid_round_changes_what_the_later_steps_train_from(tmp_path, data):
    first = SetAt(step=0, value=0.0)
    plain, g0 = _round_one(tmp_path, data, "plain")
    hooked, _ = _round_one(tmp_path, data, "mid", {0: first})
    assert first.ran == [0]
    key = next(k for k in hooked[0] if k.startswith(NAME))
    # one more step trained after the hook: not the zero it was set to, and not what training alone gives
    assert not torch.equal(hooked[0][key], -g0[NAME]) and not torch.equal(hooked[0][key], plain[0][key])
