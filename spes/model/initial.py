"""The initial MoE of a run (round 0) by the init recipe (`init.*`): upcycled from a dense checkpoint, or
from scratch. One recipe for the upcycle stage and for a comparison variant that needs its own initial model
(another expert count, or a study with other init settings), so both make it the same way."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from spes.config.schema import InitConfig, ModelConfig
from spes.model.hf import load_hf
from spes.model.transformer import CausalLM
from spes.model.upcycle import upcycle


def init_source(init: InitConfig, artifacts_dir: str) -> str:
    """'scratch', or the dense checkpoint to upcycle (init.dense_checkpoint, else the `dense` stage's model)."""
    if init.mode == "scratch":
        return "scratch"
    return init.dense_checkpoint or os.path.join(artifacts_dir, "dense", "hf")


def initial_model(cfg: ModelConfig, init: InitConfig, artifacts_dir: str) -> tuple[CausalLM, Optional[CausalLM]]:
    """The initial MoE, and the dense model it was upcycled from (None from scratch). Raises HFConversionError
    or UpcycleError for a dense checkpoint that cannot be read or does not fit `cfg`."""
    torch.manual_seed(init.seed)
    if init.mode == "scratch":
        model = CausalLM(cfg)
        with torch.no_grad():  # the router gets init.router_init_std, as an upcycled one does (0 = zeros)
            for moe in model.moe_layers():
                moe.gate.weight.normal_(0.0, init.router_init_std) if init.router_init_std > 0 else moe.gate.weight.zero_()
        return model, None
    dense = load_hf(init_source(init, artifacts_dir))
    return upcycle(dense, cfg, init.noise_std, init.noise_fraction, init.router_init_std, init.seed), dense


def init_record(model: CausalLM, init: InitConfig, source: str) -> dict:
    """What config.json beside an initial model says: its architecture, its source and the recipe's settings."""
    return {"model_config": dataclasses.asdict(model.cfg), "source": source, "init": dataclasses.asdict(init)}


def made_by(record: dict, cfg: ModelConfig, init: InitConfig, source: str) -> bool:
    """Whether the initial model `record` describes is what the recipe makes for `cfg` and `init`: same
    source, same expert count and, where the record has them (older ones do not), the same init settings."""
    return (record.get("source") == source
            and record.get("model_config", {}).get("num_experts") == cfg.num_experts
            and record.get("init", dataclasses.asdict(init)) == dataclasses.asdict(init))
