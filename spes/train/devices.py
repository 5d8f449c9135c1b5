"""Where a node computes: device choice and mixed precision.

`orchestration.device`: 'auto' = this node's GPU if CUDA is available (node i on GPU i mod visible GPUs,
so N node processes spread over a multi-GPU machine), else the CPU; 'cuda' = the same but CUDA is
required; 'cuda:K' / 'cpu' as written. Master weights and optimizer state stay fp32 whatever the device;
`train.autocast: bfloat16` runs the forward pass under torch.autocast.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from spes.config.schema import DEVICE_PATTERN
from spes.errors import DeviceError

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str, node: int = 0) -> torch.device:
    if not DEVICE_PATTERN.fullmatch(spec):
        raise DeviceError(f"device must be auto|cpu|cuda|cuda:K, got {spec!r}")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r} asked for CUDA, but torch {torch.__version__} sees no CUDA device")
    count = torch.cuda.device_count()
    index = int(spec.split(":")[1]) if ":" in spec else node % count
    if index >= count:
        raise DeviceError(f"device {spec!r}: only {count} CUDA device(s) visible")
    return torch.device("cuda", index)


def node_threads(p, nodes_here: int) -> int:
    """orchestration.threads_per_node, or this machine's cores shared among the `nodes_here` nodes it runs."""
    return p.orchestration.threads_per_node or max(1, (os.cpu_count() or 1) // max(1, nodes_here))


def autocast(device: torch.device, dtype_name: Optional[str]):
    """torch.autocast for the forward pass, or a no-op when dtype_name is None."""
    if dtype_name is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[dtype_name])
