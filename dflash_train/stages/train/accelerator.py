"""The processes a run trains on: its compute precision, its DeepSpeed config and the accelerate `Accelerator`
(one process group, DeepSpeed ZeRO or plain DDP, gloo on CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dflash_train.errors import UserError
from dflash_train.stages.train.recipe import Recipe

DeepSpeedConfig = dict[str, Any]
"""A DeepSpeed config (its JSON file, DeepSpeed's own format): the recipe's train.deepspeed, "auto"s filled."""


def train_precision(recipe: Recipe):
    """The compute precision of this run: the recipe's train.precision, `auto` resolved for the device it trains on."""
    from dflash_train.device import resolve_precision

    device = "cuda" if recipe.train.device != "cpu" and torch.cuda.is_available() else "cpu"
    return resolve_precision(recipe.train.precision, device)


def deepspeed_config(recipe: Recipe) -> DeepSpeedConfig:
    """The recipe's DeepSpeed JSON with every "auto" filled from the recipe."""
    path = Path(recipe.train.deepspeed)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    t = recipe.train
    cfg["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    cfg["gradient_accumulation_steps"] = t.grad_accum_steps
    cfg.pop("train_batch_size", None)
    cfg["gradient_clipping"] = recipe.optimizer.grad_clip
    bf16 = train_precision(recipe).name == "bf16"
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": bf16}
    if bf16:  # a non-finite gradient makes DeepSpeed skip the step (see the NaN handling in the loop)
        cfg["bf16"]["check_grad_overflow"] = True
    cfg["fp16"] = {"enabled": False}
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 2 ** 31)
    return cfg


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    t = recipe.train
    cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
    if t.device == "cuda" and not torch.cuda.is_available():
        raise UserError("recipe sets train.device: cuda but no CUDA device is available")
    env = os.environ
    if "WORLD_SIZE" not in env and "MASTER_ADDR" in env and "ACCELERATE_USE_CPU" in env:
        # accelerate's simple launcher sets MASTER_ADDR only when asked for several processes, yet starts one
        raise UserError("`accelerate launch --num_processes N` (N > 1) started a single process: on a machine "
                        "without GPUs add --multi_gpu (it launches N processes with torchrun; they use gloo)")
    if "LOCAL_RANK" not in env:  # a single process without a distributed launcher: DeepSpeed needs a group
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=env.get("MASTER_PORT") or str(_free_port()))
    kwargs: dict[str, Any] = {}
    if cpu:  # NCCL does not exist on CPU; accelerate would otherwise pick a backend that needs oneCCL or MPI
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    if t.deepspeed is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=deepspeed_config(recipe))
    # With DeepSpeed, accelerate must not be told cpu=True (it then ignores the plugin); without a GPU the
    # device is the CPU anyway. Without DeepSpeed, cpu=True selects accelerate's multi-CPU (gloo DDP) mode.
    bf16 = train_precision(recipe).name == "bf16"
    accelerator = Accelerator(cpu=cpu and t.deepspeed is None, mixed_precision="bf16" if bf16 else "no",
                              gradient_accumulation_steps=t.grad_accum_steps, **kwargs)
    if cpu and accelerator.device.type != "cpu":
        raise UserError("recipe sets train.device: cpu with DeepSpeed on a machine with GPUs: hide them with "
                        "CUDA_VISIBLE_DEVICES= or set train.deepspeed: null")
    if accelerator.device.type == "cpu":
        # accelerate's launchers export OMP_NUM_THREADS=1 by default, which would leave cores idle
        local = int(env.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(t.cpu_threads or max(1, (os.cpu_count() or 1) // local))
    launched = int(env.get("WORLD_SIZE", "1"))
    seen = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if accelerator.num_processes != launched or seen != launched:
        raise UserError(f"the launcher started {launched} process(es) (WORLD_SIZE) but this process sees "
                        f"{accelerator.num_processes} (accelerate) / {seen} (torch.distributed): the processes did "
                        f"not join one process group and would train as independent copies. Launch with "
                        f"`accelerate launch --num_processes N train.py RECIPE`")
    return accelerator


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
