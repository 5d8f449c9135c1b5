"""What crosses a node's link in one round, from the config alone (no model is built, nothing is read).

The tensor files are counted byte for byte: the same encoded tensors, in the same files, that a node
uploads (spes/sync/deltas.py: encode_upload) and downloads (spes/round/fetch.py: the aggregator's delta and
the owners' expert uploads it refers to), sized as spes/storage/tensorio.py writes them. The bundles'
manifests are counted with their file lists exact and their records (the round's metadata) estimated;
COMMIT markers are 64 bytes. tests/spes/sync/test_traffic.py holds it to the bytes a real round moves.

A steady round is one whose node holds the global it trained from (its previous round) and in which no
experts were merged: the node rebuilds the new global from the shared delta and the other owners' expert
uploads, and its own experts' new values are its own upload (held, not downloaded). A merging round
downloads every expert (each was mixed with others); a node without the previous global downloads the
whole model.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from spes.config.schema import ModelConfig, Params
from spes.model.names import canonical_shapes
from spes.storage.tensorio import Spec, file_bytes
from spes.sync.codecs import make_codec
from spes.sync.deltas import MODEL_FILE, MOMENT_KINDS, OUTER_FILE, RESIDUAL_FILE, encoded_specs
from spes.sync.method import SyncMethod

COMMIT_BYTES = 64
RECORD_BYTES = {"upload": 760, "global": 1520, "delta": 500}
"""A manifest's record (its `meta`) apart from its per-step, per-expert and per-node lists, as measured on
the test model's rounds; kilobytes either way, next to tensor files of megabytes to gigabytes."""
DIGITS = 22
"""JSON bytes per number in a record's lists (losses, expert loads) with indent=1."""


@dataclasses.dataclass
class RoundTraffic:
    """Bytes over a node's link in one round: {what: bytes} each way, and the requests (files) each way."""

    up: dict[str, int]
    down: dict[str, int]

    @property
    def up_bytes(self) -> int:
        return sum(self.up.values())

    @property
    def down_bytes(self) -> int:
        return sum(self.down.values())

    @property
    def requests(self) -> int:
        """Files moved (each a storage request): what a link's latency is paid for, at least once each."""
        return len(self.up) + len(self.down)


def _manifest_bytes(kind: str, files: dict[str, list[Spec]], record_numbers: int = 0) -> int:
    """A bundle's manifest.json: its file list exactly as spes/storage/store.py writes it, its record estimated."""
    entries = {f: {"bytes": file_bytes(specs), "sha256": "0" * 64,
                   "tensors": {n: {"dtype": str(d).removeprefix("torch."), "shape": list(sh)} for n, d, sh in specs}}
               for f, specs in files.items()}
    body = json.dumps({"files": entries, "format": "spes-bundle/1"}, indent=1, sort_keys=True).encode()
    return len(body) + RECORD_BYTES[kind] + DIGITS * record_numbers


def _split(cfg: ModelConfig, method: SyncMethod) -> tuple[dict, dict]:
    shapes = canonical_shapes(cfg)
    averaged = {n: sh for n, sh in shapes.items() if method.is_averaged(n)}
    return averaged, {n: sh for n, sh in shapes.items() if n not in averaged}


def node_round_traffic(p: Params, method: SyncMethod, node: int = 0, merging: bool = False,
                       holds_previous: bool = True) -> RoundTraffic:
    """Node `node`'s bytes up and down in one round of a run with these settings and their sync method (see
    the module doc)."""
    cfg, sync = p.model, p.sync
    codec = make_codec(sync.codec, sync.int8_block)
    averaged, experts = _split(cfg, method)
    owners = {j: method.owned(j, cfg.num_experts) for j in range(method.nodes)}

    def expert_specs(j: int) -> list[Spec]:
        return encoded_specs(codec, {n: (len(owners[j]), *sh[1:]) for n, sh in experts.items()})

    shared = encoded_specs(codec, averaged)
    upload = {"shared.safetensors": shared}
    if method.sparse_experts and experts:
        upload["experts.safetensors"] = expert_specs(node)
    if sync.average_optimizer_state:
        upload["moments.safetensors"] = [(f"{n}::{k}", torch.float32, sh) for n, sh in sorted(averaged.items())
                                         for k in MOMENT_KINDS]
    load_numbers = cfg.num_layers * cfg.num_experts if cfg.num_experts else 0
    up = {f"upload {f}": file_bytes(sp) for f, sp in upload.items()}
    up["upload manifest.json"] = _manifest_bytes("upload", upload, sync.every_steps + load_numbers)
    up["upload COMMIT"] = COMMIT_BYTES

    glob = {MODEL_FILE: [(n, torch.float32, sh) for n, sh in sorted(canonical_shapes(cfg).items())]}
    outer = [spec for n in sorted(averaged) for spec in method.outer_state_specs(n, averaged[n])]
    if outer:
        glob[OUTER_FILE] = outer
    if not codec.exact and sync.error_feedback:
        glob[RESIDUAL_FILE] = [(n, torch.float32, sh) for n, sh in sorted(averaged.items())]
    if sync.average_optimizer_state:
        glob["moments.safetensors"] = upload["moments.safetensors"]
    down = {"run info": 350 + COMMIT_BYTES, "global manifest.json": _manifest_bytes("global", glob, 3 * method.nodes),
            "global COMMIT": COMMIT_BYTES}
    if not holds_previous:
        down["global model.safetensors"] = file_bytes(glob[MODEL_FILE])
    else:
        delta = {"shared.safetensors": shared}
        if experts and (merging or not method.sparse_experts):
            delta.update({f"experts-{j:03d}.safetensors": expert_specs(j) for j in owners} if method.sparse_experts
                         else {})
        down.update({f"delta {f}": file_bytes(sp) for f, sp in delta.items()})
        if method.sparse_experts and experts and not merging:  # the other owners' uploads; its own it holds
            down.update({f"node {j} experts.safetensors": file_bytes(expert_specs(j)) for j in owners if j != node})
        down["delta manifest.json"] = _manifest_bytes("delta", delta, 8 * len(owners))
        down["delta COMMIT"] = COMMIT_BYTES
    if sync.average_optimizer_state:
        down["global moments.safetensors"] = up["upload moments.safetensors"]
    return RoundTraffic(up, down)


def largest_node_traffic(p: Params, method: SyncMethod, **kw) -> RoundTraffic:
    """The traffic of the node that moves the most bytes in a round (nodes differ when experts do not divide)."""
    return max((node_round_traffic(p, method, i, **kw) for i in range(method.nodes)),
               key=lambda t: t.up_bytes + t.down_bytes)
