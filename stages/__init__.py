"""DVC's entry points (`python -m stages.<name>`): thin wrappers over the library and the flows."""
import spes  # noqa: F401  - first, so the library pins the CPU kernels before torch loads (spes/__init__.py)
