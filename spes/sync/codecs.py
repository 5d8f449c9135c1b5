"""Codecs for what crosses the link: deltas of trained tensors (node -> storage) and of the global model
(storage -> node).

- fp32: exact.
- bf16: round to bfloat16 (half the bytes).
- int8: blockwise absmax: each block of `block` consecutive values becomes int8 codes q = round(x / s) with
  one fp32 scale s = max|x| / 127 per block (1 + 4/block bytes per value).

Decoding is a pure elementwise function computed on the CPU in fp32, so every machine that decodes the
same bytes gets the same bits: the committed global is *defined* as prev + decode(encoded delta), and a
node that applies the same decoded delta holds exactly the committed model. Error feedback (keep
x - decode(encode(x)) and add it to the next round's x) is the caller's (see spes/sync/deltas.py).

An encoded tensor `name` is stored as `name` (codes or values) plus, for int8, `name#scale`: '#' sorts
before every character of a parameter name, so a tensor's parts stay adjacent in files sorted by name.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from spes.config.schema import CODECS
from spes.errors import CodecError

SCALE = "#scale"


class Codec(ABC):
    """Encodes a tensor for the link and decodes it back: a pure function of the bytes, on the CPU."""

    name: ClassVar[str]
    """Its `sync.codec` value."""
    exact: ClassVar[bool]
    """decode(encode(x)) == x bit for bit (no error feedback needed)."""

    @classmethod
    def build(cls, int8_block: int) -> "Codec":
        """The codec with the run's sync settings (only int8 has any)."""
        return cls()

    @abstractmethod
    def encode(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts stored for tensor `name` (the tensor's own name, plus any side tensors)."""

    @abstractmethod
    def decode(self, name: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The fp32 tensor of `shape` the parts encode; CodecError when they are not such an encoding."""

    @abstractmethod
    def encoded_specs(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """What `encode` produces for a tensor of `shape` (names, dtypes, shapes), known before encoding."""


class FP32(Codec):
    name, exact = "fp32", True

    def encode(self, name, x):
        return {name: x.detach().to("cpu", torch.float32).contiguous()}

    def decode(self, name, parts, shape):
        t = parts[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != torch.float32:
            raise CodecError(f"{name}: fp32 delta of shape {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} float32")
        return t

    def encoded_specs(self, name, shape):
        return [(name, torch.float32, tuple(shape))]


class BF16(Codec):
    name, exact = "bf16", False

    def encode(self, name, x):
        return {name: x.detach().to("cpu").to(torch.bfloat16).contiguous()}

    def decode(self, name, parts, shape):
        t = parts[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != torch.bfloat16:
            raise CodecError(f"{name}: bf16 delta of shape {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} bfloat16")
        return t.float()

    def encoded_specs(self, name, shape):
        return [(name, torch.bfloat16, tuple(shape))]


class Int8(Codec):
    name, exact = "int8", False

    def __init__(self, block: int = 256):
        if block < 1:
            raise CodecError(f"int8 block must be >= 1, got {block}")
        self.block = block

    @classmethod
    def build(cls, int8_block: int) -> "Int8":
        return cls(int8_block)

    def _blocks(self, shape) -> int:
        return max(1, math.ceil(math.prod(shape) / self.block))

    def encode(self, name, x):
        flat = x.detach().to("cpu", torch.float32).reshape(-1)
        nb = self._blocks(x.shape)
        padded = torch.zeros(nb * self.block, dtype=torch.float32)
        padded[: flat.numel()] = flat
        blocks = padded.view(nb, self.block)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return {name: q.reshape(-1)[: flat.numel()].reshape(x.shape).contiguous(), name + SCALE: scale.contiguous()}

    def decode(self, name, parts, shape):
        q, scale = parts.get(name), parts.get(name + SCALE)
        nb = self._blocks(shape)
        if q is None or scale is None or q.dtype != torch.int8 or tuple(q.shape) != tuple(shape) \
                or tuple(scale.shape) != (nb,):
            raise CodecError(f"{name}: not an int8 delta of shape {tuple(shape)} with {nb} block scales "
                             f"(block {self.block})")
        n = q.numel()
        padded = torch.zeros(nb * self.block, dtype=torch.float32)
        padded[:n] = q.reshape(-1).float()
        return (padded.view(nb, self.block) * scale[:, None]).reshape(-1)[:n].reshape(shape)

    def encoded_specs(self, name, shape):
        return [(name, torch.int8, tuple(shape)), (name + SCALE, torch.float32, (self._blocks(shape),))]


CODEC_CLASSES: dict[str, type[Codec]] = {cls.name: cls for cls in (FP32, BF16, Int8)}
"""The registry `sync.codec` selects from (spes/config/schema.py's CODECS lists the same names: a test keeps them equal)."""


def make_codec(name: str, int8_block: int = 256) -> Codec:
    if name not in CODEC_CLASSES:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(CODECS)})")
    return CODEC_CLASSES[name].build(int8_block)

