"""The eval's statistics: acceptance length (tau) and acceptance by block position from verification steps, the
bootstrap intervals over prompts that every interval of the report uses, and the offline estimate (the trainer's
simulated acceptance on captured held-out samples, no target forward)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Callable, Iterator

import torch

from dflash_train.eval_report import Acceptance, OfflineEstimate, SampleTau, fields_of
from dflash_train.spec_decode.loop import Step, mean_tau

BOOTSTRAP_RESAMPLES = 2000


def acceptance_stats(step_logs: list[list[Step]], block_size: int) -> Acceptance:
    """tau and per-position acceptance of one method from its per-prompt step logs.

    tau_steps (the headline): the mean over all steps pooled, its interval over prompts a ratio of sums (a prompt
    weighs by its steps); tau_per_prompt: the mean over prompts of the mean step tau within each prompt (prompts
    that ended on the prefill token have no step and do not count). per_position_acceptance[k-1]: share of all steps
    whose tau - 1 (accepted drafts) is >= k, k = 1..B-1; so tau_steps = 1 + sum of it."""
    per_prompt = [mean_tau(steps) for steps in step_logs]
    taus = [s.tau for steps in step_logs for s in steps]
    pooled = ratio_of_sums([sum(s.tau for s in steps) for steps in step_logs], [len(steps) for steps in step_logs])
    return replace(_stats([t for t in per_prompt if t is not None], taus, block_size),
                   tau_steps_interval=bootstrap_interval(pooled, len(step_logs)),
                   tau_per_prompt_interval=bootstrap_interval(mean_of(per_prompt), len(step_logs)))


def _stats(per_unit: list[float], taus: list[int], block_size: int) -> Acceptance:
    n = len(taus)
    return Acceptance(
        tau_steps=sum(taus) / n if n else math.nan,
        tau_per_prompt=sum(per_unit) / len(per_unit) if per_unit else math.nan,
        per_position_acceptance=[sum(t - 1 >= k for t in taus) / n if n else math.nan for k in range(1, block_size)],
        tau_histogram={str(v): sum(t == v for t in taus) for v in range(1, block_size + 1)},
        num_steps=n)


def bootstrap_interval(statistic: Callable[[list[int]], float | None], n: int, resamples: int = BOOTSTRAP_RESAMPLES,
                       level: float = 0.95, seed: int = 0) -> list[float] | None:
    """The percentile interval (95%) of `statistic` over prompts: `statistic(indices)` of `resamples` resamples of
    the n prompt indices with replacement, seeded; None with fewer than two prompts. Every interval of the report
    (tau, the speedups) is this one."""
    values = sorted(v for v in map(statistic, bootstrap_resamples(n, resamples, seed)) if v is not None
                    and math.isfinite(v))
    if n < 2 or not values:
        return None
    return [values[round((1 - level) / 2 * (len(values) - 1))], values[round((1 + level) / 2 * (len(values) - 1))]]


def bootstrap_resamples(n: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Iterator[list[int]]:
    rng = random.Random(seed)
    for _ in range(resamples):
        yield [rng.randrange(n) for _ in range(n)]


def ratio_of_sums(num: list[float], den: list[float]) -> Callable[[list[int]], float | None]:
    """The statistic sum(num[i]) / sum(den[i]) over the resampled prompts i (tokens/s, a speedup: ratio of sums,
    so that long outputs weigh as much as they cost)."""
    def statistic(idx: list[int]) -> float | None:
        d = sum(den[i] for i in idx)
        return sum(num[i] for i in idx) / d if d > 0 else None
    return statistic


def mean_of(values: list[float | None]) -> Callable[[list[int]], float | None]:
    """The statistic mean(values[i]) over the resampled prompts i that have a value (tau: prompts without a
    verification step do not count)."""
    def statistic(idx: list[int]) -> float | None:
        got = [values[i] for i in idx if values[i] is not None]
        return sum(got) / len(got) if got else None
    return statistic


def offline_estimate(samples, drafter, embed: torch.Tensor, lm_head: torch.Tensor, block_size: int
                     ) -> OfflineEstimate:
    """Simulated tau from stored samples, as greedy decoding would take it (the trainer's `simulated_acceptance` at
    every anchor, walked as decoding walks it: objective.decoded_steps), with the same definition as online: per
    sample the mean over its steps, then the mean over samples (tau_per_prompt), and over all steps pooled
    (tau_steps). tau_by_k[K-1]: the per-sample mean at speculation length K;
    tau_every_anchor: the mean over every anchor instead, which overstates tau where easy and hard stretches
    alternate (objective.decoded_steps)."""
    from tqdm import tqdm

    from dflash_train.objective import decoded_steps, simulated_acceptance

    taus, ids, every_anchor, anchors = [], [], [], 0
    by_k: list[list[float]] = [[] for _ in range(1, block_size)]  # by_k[-1]: the whole block, each sample's tau
    for sample in tqdm(samples, desc="offline tau", unit="sample", leave=False):
        lengths = simulated_acceptance(drafter, embed, lm_head, sample, block_size=block_size).tolist()
        if lengths:
            walks = [decoded_steps(sample, lengths, block_size, k) for k in range(1, block_size)]
            for taus_at_k, walk in zip(by_k, walks):
                taus_at_k.append(sum(walk) / len(walk))
            taus += walks[-1]  # the whole block: K = B - 1
            ids.append(sample["id"])
            every_anchor.append(sum(lengths) / len(lengths))
            anchors += len(lengths)
    per_sample = by_k[-1]
    return OfflineEstimate(**fields_of(_stats(per_sample, taus, block_size)),
                           tau_by_k=[sum(t) / len(t) if t else math.nan for t in by_k],
                           tau_every_anchor=sum(every_anchor) / len(every_anchor) if every_anchor else math.nan,
                           num_samples=len(per_sample), num_anchors=anchors,
                           per_sample=[SampleTau(id=i, tau=t) for i, t in zip(ids, per_sample)])
