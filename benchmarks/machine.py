"""The machine a benchmark result was measured on, recorded with every result: figures from different
CPUs (instruction sets, matmul kernels, memory bandwidth) do not carry over.

Every script in this directory imports it as a sibling (`from machine import cpu_info`): run as
`python benchmarks/X.py`, the directory is first on `sys.path`.
"""

from __future__ import annotations

import os
import platform

# Instruction sets that decide which kernels MKL / oneDNN pick for fp32 and bf16 matmuls.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo_fields(path: str = "/proc/cpuinfo") -> dict:
    """The first core's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the blank line after the first core
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _model_name(fields: dict) -> str:
    return fields.get("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_model() -> str:
    """The CPU's model name (what `lscpu` prints), or the architecture where /proc is absent."""
    return _model_name(_cpuinfo_fields())


def cpu_info() -> dict:
    """The CPU: model name, the matmul-relevant instruction sets, and the kernel level torch dispatches to."""
    import torch

    fields = _cpuinfo_fields()
    flags = set(fields.get("flags", "").split())
    return {"model_name": _model_name(fields),
            "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available(), "mkldnn": torch.backends.mkldnn.is_available()}
