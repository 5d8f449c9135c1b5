"""A run on shared storage: its layout, identity and rounds, and its one-writer lease."""
from spes.runs.layout import MODEL_FILE, OUTER_FILE, RESIDUAL_FILE, RunLayout, tokens_dir
from spes.runs.lease import RunLease, RunLocked, WriterLease
from spes.runs.run import InitModel, Run, RunMismatch, fingerprint_of, settings_fingerprint

__all__ = ["MODEL_FILE", "OUTER_FILE", "RESIDUAL_FILE", "RunLayout", "tokens_dir", "RunLease",
           "RunLocked", "WriterLease", "InitModel", "Run", "RunMismatch", "fingerprint_of", "settings_fingerprint"]
