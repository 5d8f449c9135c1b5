"""Outer optimizers: how the nodes' mean delta of an averaged tensor becomes the global model's change.

Each one owns its state across rounds, per tensor: it declares which state tensors it keeps for a tensor
(`state_specs`, known before any value), takes them in and gives them back (`step`). The aggregator
streams those tensors beside the global model (`outer.safetensors`) without knowing what they are, so a
method with two state tensors per parameter (FedAdam: m and v) needs nothing outside its own module.

State tensor names are the parameter's name plus `#<kind>` ('#' sorts before every character of a
parameter name, so one tensor's state stays adjacent in name-sorted files); a single state tensor may be
named after the parameter itself (DiLoCo's momentum buffer, as committed runs hold it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Spec = tuple[str, torch.dtype, tuple[int, ...]]


class OuterOptimizer(ABC):
    """Turns the mean delta of one averaged tensor into the change the global model takes."""

    @abstractmethod
    def state_specs(self, name: str, shape: tuple[int, ...]) -> list[Spec]:
        """The state tensors kept for tensor `name` across rounds (empty: stateless)."""

    @abstractmethod
    def step(self, name: str, mean_delta: torch.Tensor,
             state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(change to the global tensor, its new state) from the nodes' mean delta and the state kept since
        the last round (empty in the first round, or after a method without state)."""


class Average(OuterOptimizer):
    """The paper's (and FedAvg's) rule: the global moves by the nodes' mean delta."""

    def state_specs(self, name, shape):
        return []

    def step(self, name, mean_delta, state):
        return mean_delta, {}


class OuterSGD(OuterOptimizer):
    """DiLoCo's outer step: SGD (Nesterov momentum by default; lr 0.7, momentum 0.9 in DiLoCo) on the
    pseudo-gradient g = -mean_delta, with torch.optim.SGD's arithmetic (dampening 0).

    Written out rather than run through torch.optim.SGD: on the CPU that fuses `g + momentum * buf` into one
    rounding (an fma), one ulp away from the two roundings every committed DiLoCo run was made with; the
    test beside it holds the two within that ulp and this one to the bits of the committed runs."""

    def __init__(self, lr: float, momentum: float, nesterov: bool):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov

    def state_specs(self, name, shape):
        return [(name, torch.float32, tuple(shape))] if self.momentum > 0 else []

    def step(self, name, mean_delta, state):
        g = -mean_delta
        if self.momentum <= 0:
            return -self.lr * g, {}
        buf = state.get(name)
        buf = g.clone() if buf is None else buf * self.momentum + g
        update = g + self.momentum * buf if self.nesterov else buf
        return -self.lr * update, {name: buf}

    def step_rows(self, name: str, delta: torch.Tensor, rows: torch.Tensor,
                  state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step on rows `rows` (dim 0) of a tensor whose rows have owners (experts: E x ...): the other
        rows change by 0 and keep their momentum; a row's buffer stays with the row, whoever trains it."""
        sub = {name: state[name][rows]} if name in state else {}
        change_rows, sub_state = self.step(name, delta[rows], sub)
        change = torch.zeros_like(delta)
        change[rows] = change_rows
        if not sub_state:
            return change, {}
        buf = state[name].clone() if name in state else torch.zeros_like(delta)
        buf[rows] = sub_state[name]
        return change, {name: buf}
