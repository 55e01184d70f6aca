"""Tolerances derived from the computation, not from one machine's rounding.

Two evaluations of the same function that differ only in the order of floating-point sums (a padded batch vs one
sample, one attention kernel vs another, a KV cache vs a full recompute) drift apart by rounding alone. A sum of n
terms rounds with an error of about eps * sqrt(n) relative to its size (per-add errors of eps / 2 with random signs),
and `depth` sums in a chain add up. So the bound on |a - b| is

    SAFETY * eps(dtype) * sqrt(reduction) * depth * scale

with `scale` the size of the compared values (their max magnitude). SAFETY = 8 covers the tail of that random walk
and CPUs whose kernels (AVX2, AVX-512, AMX) block their sums differently. A real error (a wrong mask, position or
padding) moves values by a sizable fraction of `scale`, far above this bound.
"""

from __future__ import annotations

import math

import torch

SAFETY = 8.0


def rounding_tolerance(dtype: torch.dtype, reduction: int, depth: int, scale: float | torch.Tensor) -> float:
    scale = float(scale.abs().max()) if isinstance(scale, torch.Tensor) else float(scale)
    return SAFETY * torch.finfo(dtype).eps * math.sqrt(reduction) * depth * max(scale, 1.0)


def model_tolerance(config, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """For the outputs (hidden states, logits) of a transformers decoder `config`: its widest reduction (hidden,
    MLP or, for logits, the LM head's hidden), attention + MLP per layer, plus the head."""
    reduction = max(config.hidden_size, config.intermediate_size)
    return rounding_tolerance(dtype, reduction, 2 * config.num_hidden_layers + 1, values)
