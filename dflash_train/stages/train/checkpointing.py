"""Checkpoints: where a run is (`TrainState`), the checks before any weights are written (finite, identical on
every rank), checkpoints/step-N saved atomically and pruned, and a checkpoint loaded to resume from it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch

from dflash_train.errors import UserError, in_brief, write_error
from dflash_train.provenance import StageConfig, write_json_atomic
from dflash_train.stages.train.run_folder import CHECKPOINT_PREFIX, STATE_FILE, checkpoint_dirs
from dflash_train.stages.train.validation import HeldOutMetrics


@dataclass
class TrainState:
    """Where a run is; every checkpoint's trainer_state.json holds it, and a resumed run starts from it."""
    step: int = 0  # optimizer steps done
    bad_in_a_row: int = 0  # steps skipped for a non-finite loss, in a row up to `step`
    bad_total: int = 0


class DataPosition(TypedDict):
    epoch: int
    step_in_epoch: int


class TrainerState(TypedDict, total=False):
    """A checkpoint's trainer_state.json (trainer.save_checkpoint): TrainState's fields, then the rest; a checkpoint
    written before a key was recorded lacks it."""
    step: int
    bad_in_a_row: int
    bad_total: int
    total_steps: int  # the schedule's length
    epoch: float
    world_size: int
    train_time_s: float
    last_loss: float | None
    last_eval: HeldOutMetrics
    data_position: DataPosition
    rank_parameter_digests: list[str] | None  # None under ZeRO-3 (`check_replicas`)
    recipe: StageConfig


def nonfinite_parameters(model) -> list[str]:
    """Names of the parameters that hold NaN or inf (under ZeRO-3: in this rank's partition)."""
    bad = []
    for name, p in model.named_parameters():
        part = getattr(p, "ds_tensor", None)
        values = part if part is not None and p.numel() == 0 else p
        if values.numel() and not bool(torch.isfinite(values.detach()).all()):
            bad.append(name)
    return bad


def check_weights_finite(model, accelerator, run_dir: Path, step: int, lr: float, what: str) -> None:
    """Every rank: stop (UserError on all of them) before a checkpoint or the drafter is written with NaN or inf
    weights; the checkpoints already written are kept, and the message names the newest."""
    bad = nonfinite_parameters(model)
    count = torch.tensor(float(len(bad)), device=accelerator.device)
    if accelerator.num_processes > 1:
        count = accelerator.reduce(count, reduction="sum")
    if float(count) == 0:
        return
    newest = checkpoint_dirs(run_dir)
    where = f"{newest[-1][1]} (step {newest[-1][0]})" if newest else "none (no checkpoint was written yet)"
    named = f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""
    raise UserError(f"step {step}: the drafter's weights hold NaN or inf{named}: training diverged, so "
                    f"no {what} was written. Newest good checkpoint: {where}. Lower optimizer.lr (this run: "
                    f"{lr:g}) or optimizer.grad_clip and train again")


def parameter_digest(model) -> str:
    """sha256 over every parameter's bytes: equal on all ranks iff their replicas are bit-identical."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_replicas(accelerator, model, step: int, zero_stage: int) -> list[str] | None:
    """Data parallelism (and ZeRO-1/2) keeps a full copy of the drafter on every rank; they must be identical.
    Returns every rank's digest (None under ZeRO-3, whose ranks hold different shards by design)."""
    if zero_stage >= 3:
        return None
    from accelerate.utils import gather_object

    digests = gather_object([parameter_digest(model)]) if accelerator.num_processes > 1 else [parameter_digest(model)]
    if len(set(digests)) != 1:
        raise RuntimeError(f"step {step}: the drafter's parameters differ between ranks ({digests}); the processes "
                           f"are not training one model")
    return digests


def save_checkpoint(accelerator, run_dir: Path, step: int, state: TrainerState, keep_last: int) -> Path:
    """Write checkpoints/step-N atomically (a temporary folder renamed when complete), then prune old ones."""
    final = run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_json_atomic(tmp / STATE_FILE, state)
    except (OSError, RuntimeError) as err:  # torch's writer reports a full disk as RuntimeError (basic_ios::clear)
        newest = checkpoint_dirs(run_dir)
        user = write_error(err, tmp, f"The half-written checkpoint was removed; the newest complete one is "
                                     f"{newest[-1][1] if newest else 'none yet'}. Free space and rerun the same "
                                     f"command: it resumes from there")
        shutil.rmtree(tmp, ignore_errors=True)
        if user is None:
            raise
        raise user from None
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, checkpoint: Path) -> TrainerState:
    """Load a checkpoint's model, optimizer, scheduler and RNG state into this run; returns its trainer_state.json."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as err:  # truncated or overwritten files: safetensors', torch's or DeepSpeed's own errors
        raise UserError(f"checkpoint {checkpoint} cannot be loaded ({in_brief(err)}): delete it to resume from "
                        f"an earlier one, or set checkpoint.resume: never to start over") from None
    return json.loads((checkpoint / STATE_FILE).read_text())
