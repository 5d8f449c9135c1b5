"""Every error the library raises on purpose, under one root.

`SpesError` is the root: every command line turns any of them into one line naming the problem
(spes/cli.py); anything else is a bug and keeps its traceback. The families say whose fault it is:

    ConfigError    a setting (params.yaml, an override, a preset), caught before any compute or write
    UsageError     a command line's arguments; MissingInput: what a command needs and is not there yet
    DataError      a corpus, a tokenizer or token shards
    ModelError     a checkpoint or an architecture (HF import/export, upcycling)
    StorageError   shared storage: a missing, damaged or unsafe file, storage that does not answer
    ProtocolError  the round protocol: a run, a round, an upload or a node state that does not fit
    NodeError      a node's compute: its device, a non-finite loss, its process or job

Several also derive from the builtin they refine (ValueError, RuntimeError), so callers that catch those
keep working.
"""
from __future__ import annotations

from typing import Optional


class SpesError(Exception):
    """Root of every error raised on purpose by spes, pipelines and stages."""


# -- config ------------------------------------------------------------------------------------------
class ConfigError(SpesError, ValueError):
    """A configuration problem, with a message naming the offending key."""


class OwnershipError(ConfigError):
    """An expert map that does not give every expert exactly one owner."""


# -- data --------------------------------------------------------------------------------------------
class DataError(SpesError, ValueError):
    """Token data that cannot be used (missing, truncated, foreign, too small)."""


class CorpusError(DataError):
    """A corpus or tokenizer that cannot be read."""


# -- model -------------------------------------------------------------------------------------------
class ModelError(SpesError, ValueError):
    """A checkpoint or architecture that cannot be converted or used."""


class HFConversionError(ModelError):
    pass


class UpcycleError(ModelError):
    pass


# -- storage -----------------------------------------------------------------------------------------
class StorageError(SpesError, RuntimeError):
    """Shared storage (or a node's local store) failed or holds something unusable."""


class IntegrityError(StorageError):
    """A stored file does not match its manifest (truncated, altered or foreign)."""


class NotCommitted(StorageError):
    """The bundle has no COMMIT marker: it does not exist yet."""


class AlreadyCommitted(StorageError):
    pass


class StoreUnavailable(StorageError):
    """Storage did not answer within its timeout, retries included."""


class WriterMisuse(StorageError, ValueError):
    """A tensor writer handed tensors other than the ones it announced (a caller's bug, caught before a
    wrong file is committed)."""


class UnsafePath(StorageError):
    """A path that would leave the store's root, or a name that is not safe as a path."""


# -- the round protocol ------------------------------------------------------------------------------
class ProtocolError(SpesError, RuntimeError):
    """A run, round, upload, record or node state that does not fit the protocol."""


class RecordError(ProtocolError):
    """A round record or meta that does not have the shape its reader expects (names the file)."""


class CodecError(ProtocolError, ValueError):
    """An encoded tensor that does not decode to the shape and dtype expected."""


class RunMismatch(ProtocolError):
    """Storage holds a run of this name made with other settings or another initial model."""


class RunLocked(ProtocolError):
    """Another writer holds the run's lease."""


class QuorumError(ProtocolError):
    """Fewer nodes committed than the quorum needs."""


class AggregationError(ProtocolError, ValueError):
    """An aggregation that cannot be computed: no node results, a token-weighted mean of zero tokens, a merge
    asked of a method that does not merge."""


class UploadsRejected(ProtocolError):
    """Committed uploads that failed verification; their nodes may run the round again."""

    def __init__(self, nodes: dict[int, str]):
        self.nodes = nodes
        super().__init__("rejected uploads: " + "; ".join(f"node {i}: {m}" for i, m in sorted(nodes.items())))


class MembershipError(ProtocolError, ValueError):
    """A join or leave that cannot be: an id in use, an unknown node, the last member leaving."""


class NodeStateError(ProtocolError):
    """The node state a round needs is missing, foreign or damaged."""


# -- a node's compute --------------------------------------------------------------------------------
class OptimizerStateError(NodeStateError, ValueError):
    """Optimizer state that does not fit the node's trainable parameters or experts."""


class NodeError(SpesError, RuntimeError):
    """A node could not compute its round."""


class DeviceError(NodeError):
    pass


class NonFiniteLoss(NodeError):
    pass


class NodeFailed(NodeError):
    """A node's process or job died or reported an error; `retryable`: whether another try can end otherwise
    (a dead process can; a non-finite loss or a refused state cannot). `node_error`: the node's own words,
    where they came over a carrier (a carrier that relays the failure passes them on unchanged)."""

    def __init__(self, message: str, retryable: bool = True, node_error: Optional[str] = None):
        super().__init__(message)
        self.retryable = retryable
        self.node_error = node_error


def retryable(e: BaseException) -> bool:
    """Whether the same call can succeed when tried again: our own errors say something definite, except
    storage that did not answer and a node whose process died."""
    if isinstance(e, NodeFailed):
        return e.retryable
    return not isinstance(e, SpesError) or isinstance(e, StoreUnavailable)


# -- command lines -----------------------------------------------------------------------------------
class UsageError(SpesError, ValueError):
    """A command line's arguments that cannot be carried out as given (a malformed or missing option)."""


class MissingInput(SpesError, RuntimeError):
    """What a command needs and is not there yet: an earlier stage's output, a committed round, a setting of
    the environment (the message says how to make it)."""


# -- orchestration -----------------------------------------------------------------------------------
class OrchestrationError(SpesError, RuntimeError):
    """The orchestrator's own services (the local Prefect server) failed to start or answer."""
