"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", arXiv 2003.00295): every node trains the
whole model; the server takes an Adam step on the pseudo-gradient g = -mean(delta_i), keeping Adam's two
moments (and its step count) per tensor across rounds.

The step is torch.optim.Adam's own (not a copy of its arithmetic): for each tensor the server runs Adam on
a zero tensor whose gradient is g, with the moments kept since the last round, and takes the result as the
global's change, so the committed global is prev + change like every other method's (and a lossy codec's
rounding of the change is the same rule). Hyper-parameters: outer.lr (the server rate; Reddi et al.
tune it around 1e-2..1e-1 — DiLoCo's 0.7 is an SGD rate, far too large here), outer.momentum as beta1,
outer.beta2, outer.eps (Reddi et al.'s tau, 1e-3: it bounds the step where v is tiny). Adam's
bias correction is kept (torch's), so the first rounds are not damped by the zero-initialised moments.
"""
from __future__ import annotations

import torch

from spes.sync.method import FullModelMethod
from spes.sync.outer import OuterOptimizer

KINDS = ("exp_avg", "exp_avg_sq", "step")
"""Adam's per-tensor state, as torch.optim.Adam names it, stored as `<name>#<kind>`."""


class OuterAdam(OuterOptimizer):
    def __init__(self, lr: float, beta1: float, beta2: float, eps: float):
        self.lr, self.betas, self.eps = lr, (beta1, beta2), eps

    def state_specs(self, name, shape):
        return [(f"{name}#exp_avg", torch.float32, tuple(shape)), (f"{name}#exp_avg_sq", torch.float32, tuple(shape)),
                (f"{name}#step", torch.float32, ())]

    def step(self, name, mean_delta, state):
        change = torch.zeros_like(mean_delta, dtype=torch.float32, requires_grad=True)
        opt = torch.optim.Adam([change], lr=self.lr, betas=self.betas, eps=self.eps, foreach=False)
        if state:
            opt.state[change] = {k: state[f"{name}#{k}"].clone() for k in KINDS}
        change.grad = -mean_delta.float()
        opt.step()
        kept = opt.state[change]
        return change.detach(), {f"{name}#{k}": kept[k] for k in KINDS}


class FedAdam(FullModelMethod):
    name = "fedadam"

    def outer_optimizer(self) -> OuterOptimizer:
        o = self.outer_settings
        return OuterAdam(o.lr, o.momentum, o.beta2, o.eps)
