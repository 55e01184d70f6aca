"""What a run measures and where it writes it: `StepStats` (one optimizer step, summed over ranks), `MetricsLog`
(metrics.jsonl, one row per logged step and per eval) and the optional wandb run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.errors import UserError
from dflash_train.stages.train.recipe import Recipe


@dataclass
class StepStats:
    """What one optimizer step measured, summed over its micro steps (and, after `summed_over_ranks`, over ranks)."""
    loss_sum: torch.Tensor  # float64 []: the finite micro-step losses (each a weighted mean), summed
    micro_steps: torch.Tensor  # float64 []
    tokens: torch.Tensor  # float64 []: real tokens read (padding excluded)
    correct: torch.Tensor  # float64 [B]: correct greedy predictions per block slot
    counted: torch.Tensor  # float64 [B]: supervised predictions per block slot
    skipped: bool = False  # a non-finite loss (on any rank): no optimizer step was taken
    grad_norm: torch.Tensor | float | None = None  # as clip_grad_norm_ returns it (None when skipped)
    kl: torch.Tensor | None = None  # the last micro batch's KL to the target's top-k (this rank's), or None
    lr: float = 0.0  # the learning rate the step used
    seconds: float = 0.0

    @classmethod
    def zeros(cls, block_size: int) -> "StepStats":
        zero = torch.zeros((), dtype=torch.float64)
        return cls(zero.clone(), zero.clone(), zero.clone(), torch.zeros(block_size, dtype=torch.float64),
                   torch.zeros(block_size, dtype=torch.float64))

    SUMMED = ("loss_sum", "micro_steps", "tokens", "correct", "counted")

    def summed_over_ranks(self, accelerator) -> "StepStats":
        """The counters summed over all ranks, in one all-reduce."""
        parts = [getattr(self, name).reshape(-1) for name in self.SUMMED]
        total = accelerator.reduce(torch.cat(parts).to(accelerator.device), reduction="sum").cpu()
        summed = dict(zip(self.SUMMED, total.split([p.numel() for p in parts])))
        return dataclasses.replace(self, **{k: v.reshape(getattr(self, k).shape) for k, v in summed.items()})

    @property
    def loss(self) -> float:
        """Mean micro-step loss; NaN for a skipped step."""
        return math.nan if self.skipped else float(self.loss_sum / self.micro_steps)

    def accuracy(self) -> list[float | None]:
        """Greedy accuracy of block slots 1..B-1 (slot 0, the anchor, is not predicted)."""
        return [round(float(c / n), 4) if n else None for c, n in zip(self.correct[1:], self.counted[1:])]


class MetricsLog:
    """metrics.jsonl (main process) and wandb (when enabled)."""

    def __init__(self, path: Path, enabled: bool, wandb_run=None):
        self.path = path
        self.enabled = enabled
        self.wandb_run = wandb_run

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows a killed run logged after the checkpoint it resumes from."""
        if not self.enabled or not self.path.exists():
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if json.loads(r).get("step", 0) <= step]
        self.path.write_text("".join(r + "\n" for r in kept))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])


def start_wandb(recipe: Recipe, run_dir: Path, enabled: bool):
    mode = os.environ.get("WANDB_MODE") or recipe.logging.wandb_mode
    if not enabled or mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        raise UserError("recipe logging.wandb_mode is not 'disabled' but wandb is not installed "
                        "(pip install wandb, or set logging.wandb_mode: disabled)") from None
    return wandb.init(project=recipe.logging.wandb_project, name=recipe.logging.wandb_run_name or recipe.name,
                      config=recipe.to_dict(), mode=mode, dir=str(run_dir), resume="allow",
                      id=hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16])
