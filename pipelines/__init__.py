"""Prefect flows and the node transports around the library."""
import spes  # noqa: F401  - first, so the library pins the CPU kernels before torch loads (spes/__init__.py)
