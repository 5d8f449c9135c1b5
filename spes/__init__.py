"""SPES: sparse expert synchronization for decentralized MoE pretraining (the library; no orchestration).

On x86-64 CPUs the library pins the kernels PyTorch, MKL and oneDNN choose to the AVX2 ones, unless the
environment already chooses: each picks its kernels from the CPU it runs on, and AVX-512 kernels sum in
another order, so a machine with AVX-512 and one without trained the embedded default to held-out losses
4.27056598622193 and 4.26582724854252 (measured: ATEN_CPU_CAPABILITY=avx2 alone turns the first machine's
result into the second's, bit for bit). Every x86-64 machine of the last decade has AVX2. It works only
when it runs before torch is first imported, so it is skipped otherwise: a process and the node processes
it starts then all keep the kernels the process already has.
"""
import os
import platform
import sys
import tempfile

CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""What the library sets (os.environ.setdefault) before torch loads; set any of them to choose otherwise."""

if "torch" not in sys.modules and platform.machine().lower() in ("x86_64", "amd64"):
    for _key, _value in CPU_KERNELS.items():
        os.environ.setdefault(_key, _value)
    # torch.compile's CPU kernels cached by a process with other kernels abort here when loaded (torch 2.13:
    # "index out of bounds" in a generated kernel): these processes keep their own cache
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getattr(os, 'getuid', lambda: 0)()}_{os.environ['ATEN_CPU_CAPABILITY']}"))
