"""What a new machine pays once, paid by `make install` instead of the first run that needs it:

- the embedded target converted from its GGUF to a checkpoint (~/.cache/dflash_train; ~25 s on 2 cores);
- DeepSpeed's CPU communication op compiled (~/.cache/torch_extensions; ~40 s), which the first training on a CPU
  builds before its first step;
- vLLM's inspection of the target's and the DFlash drafter's architectures, each in a process of its own
  (~/.cache/vllm/modelinfos; ~11 s each), which the first engine to load each pays.

On a new 2-core machine the first `make demo` otherwise measured vLLM's start at 40 s in its probe (16 s once
cached), planned capture 350 s for what took 152, and its training started 39 s into its stage
(BENCHMARKS "The demo's probe and plan").

    python scripts/warm_up.py          # each step says what it did; a second run finds everything cached
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from dflash_train.support.runs import REPO

GENERAL_DRAFTER = REPO / "drafters" / "smollm2-135m-instruct-general"


def deepspeed_cpu_op() -> str:
    """Compile (or find compiled) the communication op DeepSpeed's torch backend builds when training starts: its
    own `build_shm_op`, which builds the shared-memory op where the accelerator is the CPU, none elsewhere."""
    from deepspeed.comm.torch import build_shm_op

    return "DeepSpeed's CPU communication op ready" if build_shm_op() is not None else \
        "DeepSpeed: no CPU communication op on this accelerator"


def vllm_engines(target: Path) -> str:
    """Start vLLM once on the target, plain and with the shipped general drafter, in the engine child the stages
    use, decoding a few tokens."""
    from dflash_train.device import default_device
    from dflash_train.engine import install
    from dflash_train.engine.jobs import EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine

    if install.vllm_version() is None:
        return "vLLM is not installed: nothing to warm"
    job = EngineJob(target=str(target), requests=[EngineRequest("warm-up", [1, 2, 3, 4], max_tokens=4)],
                    stop_token_ids=[], mode="check", drafter=str(GENERAL_DRAFTER), speculative_tokens=[1],
                    max_model_len=256, device=default_device())
    with tempfile.TemporaryDirectory() as work:
        result = run_engine(job, work, "vLLM's first start (warm-up)")
    return f"vLLM {result.version} started on the target, plain and with a DFlash drafter"


def main() -> int:
    from dflash_train.target import DEFAULT_TARGET, resolve_target

    steps = (lambda: f"the embedded target ready: {resolve_target(DEFAULT_TARGET).name}",
             deepspeed_cpu_op, lambda: vllm_engines(resolve_target(DEFAULT_TARGET)))
    for step in steps:
        t0 = time.perf_counter()
        said = step()
        print(f"warm-up: {said} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
