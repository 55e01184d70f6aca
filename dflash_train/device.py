"""Where a stage computes, and in which dtype: the one rule every stage (capture, train, eval, benchmarks) follows.

`auto` picks bf16 where the device runs it natively and fp32 elsewhere:
  - CUDA: bf16 when the GPU supports it (Ampere and newer), else fp32;
  - x86 CPU: bf16 only with AVX512_BF16 or AMX-BF16 instructions *and* PyTorch dispatching AVX-512 kernels. On an
    AVX2-only CPU bf16 is emulated: matrix products measured 2.4-9 GFLOP/s in bf16 against 20-27 in fp32, so a
    bf16 capture or training step runs 3-10x slower there;
  - Arm CPU: bf16 when the CPU lists the bf16 feature (Neoverse V1/V2, Graviton 3+).
An explicit `bf16`, `fp16` or `fp32` is always honoured. `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` makes
an AVX-512 machine behave as an AVX2 one (PyTorch then reports capability AVX2 and `auto` picks fp32).

The choice and its reason are printed by each stage and recorded in its provenance.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 /proc/cpuinfo flags of native bf16 dot products


@dataclass(frozen=True)
class Precision:
    name: str  # bf16 | fp16 | fp32
    reason: str  # why: "requested", or what the hardware probe found

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"

    def as_dict(self) -> dict[str, str]:
        return {"compute_dtype": self.name, "reason": self.reason}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_problem(name: str | None) -> str | None:
    """A --device option's check (options.Check): what is wrong with `name` on this machine, or None."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return "is not a device (cpu, cuda or cuda:N)"
    if device.type not in ("cpu", "cuda"):
        return "is not a device this tool computes on (cpu, cuda or cuda:N)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "names a GPU, and no CUDA device is available here"
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        return f"names GPU {device.index}, and this machine has {torch.cuda.device_count()}"
    return None


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`) from /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def machine(device: str | torch.device = "cpu") -> dict[str, object]:
    """What measured a timing: the CPU model and the cores this process may use, the GPU where `device` is one,
    and the load average (1, 5, 15 min) when it was asked: other jobs on the machine slow every timing."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info: dict[str, object] = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    if torch.device(device).type == "cuda":
        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}"
    return info


def native_bf16(device: str | torch.device) -> tuple[bool, str]:
    """(whether `device` computes bf16 natively, the evidence in words)."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'lacks'} bf16"
    if device.type != "cpu":
        return False, f"{device.type}: no bf16 probe, fp32 is the safe choice"
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        ok = "bf16" in flags
        return ok, f"Arm CPU {'with' if ok else 'without'} the bf16 feature"
    found = [f for f in CPU_BF16_FLAGS if f in flags]
    if not found:
        return False, f"CPU {capability} without {' or '.join(CPU_BF16_FLAGS)}: bf16 would be emulated"
    if not capability.startswith("AVX512"):
        return False, f"CPU has {', '.join(found)} but PyTorch dispatches {capability} kernels: bf16 would be emulated"
    return True, f"CPU {capability} with {', '.join(found)}"


def resolve_precision(requested: str, device: str | torch.device) -> Precision:
    """`auto` -> bf16 where `device` runs it natively, else fp32; anything else is taken as asked."""
    if requested == "auto":
        ok, why = native_bf16(device)
        return Precision("bf16" if ok else "fp32", f"auto: {why}")
    if requested not in DTYPES:
        raise UserError(f"compute dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
    return Precision(requested, "requested")
