"""Where a run stands and what that decides: the training clock against its time budget, the learning-rate factor
of each step and the context warm-up of the first steps."""

from __future__ import annotations

import math
import time

from dflash_train.stages.train.recipe import Recipe


def lr_factor(step: int, total_steps: int, warmup_ratio: float, schedule: str, min_ratio: float,
              decay_ratio: float = 0.2, progress: float | None = None) -> float:
    """Linear warmup over warmup_ratio of the run, then cosine to min_ratio, constant, or wsd (constant, then a
    linear decay to min_ratio over the last decay_ratio of the run). The run's position is step / total_steps, or
    `progress` (the fraction of a time budget used) when given."""
    if progress is None:
        warmup = int(math.ceil(warmup_ratio * total_steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = step / max(1, total_steps)
        after = (step - warmup) / max(1, total_steps - warmup)
    else:
        progress = min(1.0, max(0.0, progress))
        if progress < warmup_ratio:
            return max(progress / warmup_ratio, 1.0 / max(1, total_steps))
        after = (progress - warmup_ratio) / max(1e-9, 1 - warmup_ratio)
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        start = 1.0 - decay_ratio
        if progress <= start:
            return 1.0
        return min_ratio + (1 - min_ratio) * max(0.0, 1 - (progress - start) / decay_ratio)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, after)))


def in_context_warmup(recipe: Recipe, step: int, total_steps: int, clock: "TrainClock") -> bool:
    """Whether this step's blocks see only the last context_warmup_window context positions (the first
    objective.context_warmup_ratio of the run)."""
    progress = clock.progress_at(step, total_steps)
    return (progress if progress is not None else step / max(1, total_steps)) < recipe.objective.context_warmup_ratio


class TrainClock:
    """Training time (evals and checkpoints excluded) against an optional budget; survives resume."""

    def __init__(self, budget_s: float | None, already_s: float = 0.0):
        self.budget_s = budget_s
        self.spent_s = already_s
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.time()

    def pause(self) -> None:
        if self._since is not None:
            self.spent_s += time.time() - self._since
            self._since = None

    @property
    def elapsed(self) -> float:
        return self.spent_s + (time.time() - self._since if self._since is not None else 0.0)

    def progress_at(self, step: int, total_steps: int) -> float | None:
        """Where a budgeted run stands: the larger of the time and the step fraction, since it ends at whichever
        limit comes first (so the schedule decays either way); None without a budget (the schedule counts steps)."""
        if self.budget_s is None:
            return None
        return max(self.elapsed / self.budget_s, step / max(1, total_steps))

    @property
    def expired(self) -> bool:
        return self.budget_s is not None and self.elapsed >= self.budget_s
