"""Who may touch what on shared storage: the least each role needs, as path patterns of the run's layout.

A *node machine* (the nodes it trains) reads the run's identity, the committed globals and their deltas (with
the owners' uploaded experts they refer to), the token shards, and its own nodes' uploads and states; it writes and deletes only its own nodes' uploads,
states, heartbeats and join/leave requests. The *orchestrator* (it holds the run's lease and aggregates)
owns the run: it writes the globals, deltas, records, lease and identity, publishes the token shards, sets
rejected uploads aside and performs retention, so it reads, writes and deletes under the run's prefix.

Listing: S3 answers "not found" rather than "forbidden" only to a principal that may list the bucket, and
fsspec's `exists` lists a path's prefix when no object has its exact name, so both roles may list names
under the run's prefix and the token data (names, never contents). `iam_policy` writes these grants as an
AWS IAM policy (`python -m spes.policy` prints it). Patterns use `*` for any run of characters, as IAM does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from spes.errors import ConfigError
from spes.run.layout import ANY_ROUND, TOKENS_ROOT, RunLayout
from spes.sync.deltas import EXPERTS_FILE


@dataclass(frozen=True)
class Grants:
    """Object-key patterns relative to the storage root."""

    role: str
    read: tuple[str, ...]
    write: tuple[str, ...]  # put and delete
    list_prefixes: tuple[str, ...]


def node_grants(layout: RunLayout, nodes: Sequence[int]) -> Grants:
    if not nodes or any(not isinstance(i, int) or i < 0 for i in nodes):
        raise ConfigError(f"a node machine's grants need its node ids (integers >= 0), got {list(nodes)!r}")
    own: list[str] = []
    for i in sorted(set(nodes)):
        own += [f"{layout.node_dir(ANY_ROUND, i)}/*", f"{layout.state_dir(ANY_ROUND, i)}/*", layout.heartbeat(i),
                *(layout.request_file(kind, i) for kind in layout.REQUEST_KINDS)]
    # a delta refers to each owner's uploaded experts instead of copying them (spes/round/attempt.py): a node
    # rebuilding the global reads every node's experts file, never the rest of another node's upload
    shared = [f"{layout.info}/*", f"{layout.global_dir(ANY_ROUND)}/*", f"{layout.delta_dir(ANY_ROUND)}/*",
              f"{layout.round_dir(ANY_ROUND)}/nodes/*/{EXPERTS_FILE}", f"{layout.membership_dir}/*", f"{TOKENS_ROOT}/*"]
    names = ",".join(str(i) for i in sorted(set(nodes)))
    return Grants(f"node machine (nodes {names})", tuple(shared + own), tuple(own),
                  (f"{layout.base}/*", f"{TOKENS_ROOT}/*"))


def orchestrator_grants(layout: RunLayout) -> Grants:
    everything = (f"{layout.base}/*", f"{TOKENS_ROOT}/*")
    return Grants("orchestrator", everything, everything, everything)


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of an s3:// storage URL; the prefix without slashes at its ends ('' at the bucket's root)."""
    if not url.startswith("s3://") or not url[len("s3://"):].split("/", 1)[0]:
        raise ConfigError(f"storage.url must be s3://BUCKET[/PREFIX] for an S3 policy, got {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def iam_policy(grants: Grants, bucket: str, prefix: str) -> dict:
    """The grants as an AWS IAM identity policy for the key of that role (objects under s3://bucket/prefix)."""
    def key(pattern: str) -> str:
        return f"{prefix}/{pattern}" if prefix else pattern

    def objects(patterns) -> list[str]:
        return [f"arn:aws:s3:::{bucket}/{key(p)}" for p in patterns]

    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "Read", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": objects(grants.read)},
        {"Sid": "WriteAndDelete", "Effect": "Allow",
         "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"], "Resource": objects(grants.write)},
        {"Sid": "ListNames", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
         "Condition": {"StringLike": {"s3:prefix": [key(p) for p in grants.list_prefixes]}}},
    ]}
