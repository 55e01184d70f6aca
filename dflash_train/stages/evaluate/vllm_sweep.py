"""The eval in vLLM, the serving engine itself: plain decoding and the drafter as vLLM's `dflash` speculator at each
speculation length K, timed (engine.child._timed) at batch 1 and with requests decoded together; the fastest K at
batch 1 (best_k) is the entry's headline; vLLM's model-free speculators (prompt lookup, suffix decoding) timed the
same way beside it; plain decoding's own speed over the sweep says whether the machine held still while it measured."""

from __future__ import annotations

import math
import os
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_train.engine.args import serve_command
from dflash_train.engine.child import idle_s
from dflash_train.engine.jobs import LOOKUP_METHODS, EngineJob, EngineOutput, EngineResult, engine_steps, free_job
from dflash_train.errors import UserError
from dflash_train.eval_report import (CombinedEntry, ConcurrencyRow, FirstK, KRow, LoadSeconds, Lossless, Mismatch,
                                      Paired, RankRow, SourceCount, SpeculatorEntry, Speed, SweepTiming, TimedPrompt,
                                      VllmEval, fields_of)
from dflash_train.spec_decode.lookup import SUFFIX_SCORE, CombinedRule, parse_combined
from dflash_train.spec_decode.loop import mean_tau
from dflash_train.spec_decode.suffix import suffix_problem
from dflash_train.stages.evaluate.config import EvalConfig
from dflash_train.stages.evaluate.engine_runs import EngineRunner
from dflash_train.stages.evaluate.metrics import (acceptance_stats, bootstrap_interval, bootstrap_resamples,
                                                  ratio_of_sums)
from dflash_train.stages.evaluate.own_loop import diagnose_mismatch
from dflash_train.target import Target


CLOCKS = ("core_s", "decode_s", "wall_s")  # engine core: arrival to last token, first to last token; stopwatch
TIMING = tuple(f"{side}_{clock}" for side in ("plain", "spec") for clock in CLOCKS)
FIGURES = tuple(f.name for f in fields(Speed) if not f.name.endswith("_interval"))  # of a concurrency run
TIMING_PROTOCOL = ("warm engines (one short request each first), plain decoding and the speculators side by side in "
                   "one process; each prompt decoded alone by plain decoding to its natural stop (the reference and "
                   "plain decoding's timed run), then by each speculator at that length with ignore_eos (the same "
                   "number of new tokens on every side), the speculators' order rotated from prompt to prompt; the "
                   "drafter's first K, the baseline drafter at that K and the free speculators share plain decoding's "
                   "run, each further K and the combined speculator are timed beside a plain run of their own at that "
                   "length, alternating which goes first; each request {idle} with its engine's prefix cache "
                   "emptied (every timed prompt prefilled in full); timed by the engine core from the request's "
                   "arrival to its last token (the decode phase alone: from its first token) and by a stopwatch "
                   "around the whole request; concurrency c: the first c prompts (cycled) decoded together, timed the "
                   "same way")


SWEEP_FIRST_SLACK = 0.01  # the sweep's first K keeps the expected speed within 1% of the best, by the estimate


def sweep_first_k(tau_by_k: list[float] | None, step_cost: list[float] | None = None,
                  slack: float = SWEEP_FIRST_SLACK) -> int | None:
    """The shortest speculation length K whose expected speed, its expected tau (tau_by_k[K-1]) over what a
    verification step costs at K, is within `slack` of the best. With `step_cost` (a, b) a step at K costs a + b x K
    plain decoding steps (as `step_cost` measures it: on a 2-core CPU 1.40 at K = 1 and 1.87 at 15); without,
    the same at every K, so that no longer K is more than `slack` faster by the expected tau alone. None without an
    estimate."""
    if not tau_by_k or not all(math.isfinite(t) for t in tau_by_k):
        return None
    a, b = step_cost or (1.0, 0.0)
    speed = [tau / (a + b * k) for k, tau in enumerate(tau_by_k, 1)]
    return next(k for k, s in enumerate(speed, 1) if s * (1 + slack) >= max(speed))


def step_cost(step_logs: list[list], per_prompt: list[TimedPrompt]) -> float | None:
    """What a verification step cost in one K's timed runs at batch 1 (k_row's steps and per-prompt mean times), in
    plain decoding steps: the speculative side's decode-phase seconds per verification step over plain decoding's
    per token (the same prompts at the same lengths); None where either side has none."""
    steps = sum(map(len, step_logs))
    tokens = sum(p.new_tokens - 1 for p in per_prompt)
    spec_s, plain_s = sum(p.spec_decode_s for p in per_prompt), sum(p.plain_decode_s for p in per_prompt)
    return (spec_s / steps) / (plain_s / tokens) if steps and tokens and spec_s > 0 and plain_s > 0 else None


def step_cost_line(costs: dict[int, float]) -> list[float]:
    """(a, b), a step at K costing a + b x K plain steps, through two K's measured costs (b at least 0: a longer
    block is never cheaper to verify)."""
    (k1, c1), (k2, c2) = sorted(costs.items())
    b = max(0.0, (c2 - c1) / (k2 - k1))
    return [c1 - b * k1, b]


def tau_by_k_of(acceptance: list[float]) -> list[float]:
    """Expected tau at each K from the acceptance by block position of steps at the whole block (the share of steps
    accepting at least k drafts): 1 + acceptance[0] + ... + acceptance[K-1]."""
    return [1 + sum(acceptance[:k]) for k in range(1, len(acceptance) + 1)]


def k_sweep_order(max_k: int, first: int | None = None) -> list[int]:
    """The speculation lengths 1..max_k in the order the eval times them: `first` (sweep_first_k; default max_k, the
    whole block, what vLLM ran before the sweep), 1, then again and again the geometric middle of the widest gap
    left below `first`; then max_k and the gaps above `first` the same way. A sweep that its budget cuts short has
    timed the likeliest fastest K and spans the range below it."""
    first = max_k if first is None else min(first, max_k)
    order = [first] + ([1] if first > 1 else [])
    for top in (first, max_k):
        order += [top] if top not in order else []
        while len(done := sorted(k for k in order if k <= top)) < top:
            _, _, a, b = max((math.log(b / a), -a, a, b) for a, b in zip(done, done[1:]) if b - a > 1)
            order.append(min(max(round(math.sqrt(a * b)), a + 1), b - 1))
    return order


HOST_DRIFT_LIMIT = 0.15  # plain decoding's own speed may move this much over a sweep before the report says the
#                        machine changed speed while it measured (quiet 2-core hosts: 3-10%; 30% and 72% where a
#                        speedup above 1 at tau 1.26-1.30 proved to be noise: BENCHMARKS.md)


def plain_rates(natural: dict[str, EngineOutput], sweep: list[KRow]) -> list[float | None]:
    """Plain decoding's decode-phase tokens/s in the reference pass (every prompt to its natural stop, before any
    K) and in each row's timed runs (each K's, then prompt lookup's): the same engine on the same prompts at the
    same lengths, so on a steady machine the same figure; how far they move apart is how far the machine's speed
    moved while the sweep measured."""
    seconds = sum(o.decode_s for o in natural.values())
    reference = sum(len(o.token_ids) - 1 for o in natural.values()) / seconds if seconds > 0 else None
    return [reference, *(row.tokens_per_s_baseline_decode for row in sweep)]


def host_drift(rates: list[float | None]) -> float | None:
    """The fastest of plain decoding's rates over the slowest, less 1; None with fewer than two."""
    rates = [r for r in rates if r]
    return max(rates) / min(rates) - 1 if len(rates) > 1 else None


def timing_figures(rows: list[TimedPrompt], intervals: bool = True) -> Speed:
    """Tokens/s of both sides and the speedup over timed runs (`rows`: new_tokens, requests and the mean seconds of
    each side by each clock), by the engine core over the whole request (every new token, prefill included: the
    headline), over the decode phase alone (tokens after each request's first, as the project's loop counts:
    `_decode`) and by the stopwatch (`_wall`); ratios of sums, with bootstrap intervals over the rows."""
    def figures(tokens: list[int], plain: list[float], spec: list[float]) -> tuple:
        everything = list(range(len(rows)))
        return (ratio_of_sums(tokens, spec)(everything), ratio_of_sums(tokens, plain)(everything),
                ratio_of_sums(plain, spec)(everything),
                bootstrap_interval(ratio_of_sums(plain, spec), len(rows)) if intervals else None)

    tokens = [r.new_tokens for r in rows]
    core = figures(tokens, [r.plain_core_s for r in rows], [r.spec_core_s for r in rows])
    decode = figures([r.new_tokens - r.requests for r in rows], [r.plain_decode_s for r in rows],
                     [r.spec_decode_s for r in rows])
    wall = figures(tokens, [r.plain_wall_s for r in rows], [r.spec_wall_s for r in rows])
    return Speed(*core, *decode, *wall)


def _mean_times(run: dict[str, Any]) -> dict[str, float]:
    return {key: sum(run[key]) / len(run[key]) for key in TIMING}


def taken(run: dict[str, Any], refused: dict[str, str]) -> dict[str, Any]:
    """A timed run (engine.child._timed) without the prompts `refused` names, the eval's one rule for a prompt vLLM
    refuses: refused by any engine run (the first, a later K's, prompt lookup's, suffix decoding's, the combined
    speculator's, an fp32 recheck's), it is left out of every run's comparison, so that every row and every pairing
    holds the same prompts. Its batches of requests decoded together stay as timed (the same batch on both sides)."""
    return {**run, "batch1": [t for t in run["batch1"] if t["id"] not in refused],
            "outputs": [o for o in run["outputs"] if o["id"] not in refused]}


def k_row(run: dict[str, Any], natural: dict[str, EngineOutput], greedy: bool) -> KRow:
    """One speculation length's figures from its timed runs (engine.child._timed): tau and acceptance by position from
    vLLM's verification steps, tokens/s and speedup by each clock with intervals, the lossless check against the
    plain outputs, and the per-prompt figures."""
    spec = {o["id"]: EngineOutput(**o) for o in run["outputs"]}
    step_logs, per_prompt, unaccounted, spreads = [], [], 0, []
    for timed in run["batch1"]:
        out = spec[timed["id"]]
        steps, left = engine_steps(out, undrafted_steps=run.get("method") in LOOKUP_METHODS)
        step_logs.append(steps)
        unaccounted += left
        times = _mean_times(timed)
        prompt = TimedPrompt(id=timed["id"], new_tokens=timed["tokens"], requests=1, tau=mean_tau(steps),
                             mismatch=greedy and out.token_ids != natural[timed["id"]].token_ids, **times,
                             # 0: both prefilled every prompt in full
                             plain_cached_tokens=max(timed.get("plain_cached_tokens") or [0]),
                             spec_cached_tokens=max(timed.get("spec_cached_tokens") or [0]))
        per_prompt.append(replace(prompt, speedup=prompt.plain_core_s / prompt.spec_core_s,
                                  speedup_decode=prompt.plain_decode_s / prompt.spec_decode_s,
                                  speedup_wall=prompt.plain_wall_s / prompt.spec_wall_s))
        spreads += [(max(v) - min(v)) / (sum(v) / len(v)) for key in TIMING if len(v := timed[key]) > 1]
    return KRow(**fields_of(acceptance_stats(step_logs, run["k"] + 1), timing_figures(per_prompt)), k=run["k"],
                lossless_checked=len(per_prompt) if greedy else 0,
                lossless_mismatches=sum(p.mismatch for p in per_prompt) if greedy else None,
                step_cost=step_cost(step_logs, per_prompt), tokens_unaccounted_by_steps=unaccounted,
                load_s=run["load_s"], seconds=run["seconds"],
                repeat_spread=sorted(spreads)[len(spreads) // 2] if spreads else None, per_prompt=per_prompt)


def fastest_at_batch_1(rows: list[KRow]) -> KRow:
    """The row of the fastest K at batch 1, by the engine's speedup (a K without a finite one comes last)."""
    return max(rows, key=lambda row: row.speedup if math.isfinite(row.speedup or math.nan) else -1.0)


def best_k_share(sweep: list[KRow], best: int) -> float | None:
    """How often `best` is the fastest K at batch 1 when the prompts are resampled (the bootstrap of the
    intervals): near 1, another set of prompts would pick it too."""
    if len(sweep) < 2:
        return None
    stats = [(row.k, ratio_of_sums([p.plain_core_s for p in row.per_prompt], [p.spec_core_s for p in row.per_prompt]))
             for row in sweep]
    n = len(sweep[0].per_prompt)
    wins = [max(stats, key=lambda ks: ks[1](idx) or 0.0)[0] == best for idx in bootstrap_resamples(n)]
    return sum(wins) / len(wins)


def concurrency_rows(sweep: list[KRow], runs: list[dict[str, Any]]) -> list[ConcurrencyRow]:
    """Every (concurrency, K) measured: batch 1 from the sweep, the others from the concurrency runs."""
    rows = [ConcurrencyRow(**{key: getattr(row, key) for key in FIGURES}, requests=1, k=row.k) for row in sweep]
    for run in runs:
        for timed in run["concurrency"]:
            mean = TimedPrompt(new_tokens=timed["tokens"], requests=timed["requests"], **_mean_times(timed))
            rows.append(ConcurrencyRow(**fields_of(timing_figures([mean], intervals=False)),
                                       requests=timed["requests"], k=run["k"]))
    return sorted(rows, key=lambda r: (r.requests, r.k))


def best_per_concurrency(rows: list[ConcurrencyRow]) -> list[ConcurrencyRow]:
    """For each concurrency, its fastest K (by the engine's speedup) and its figures."""
    best: dict[int, ConcurrencyRow] = {}
    for row in rows:
        if row.requests not in best or (row.speedup or 0) > (best[row.requests].speedup or 0):
            best[row.requests] = row
    return [best[c] for c in sorted(best)]


def pays_up_to(best: list[ConcurrencyRow]) -> int:
    """The largest measured concurrency up to which speculation (at its best K) beats plain decoding at every
    measured concurrency; 0 when it does not even at batch 1."""
    paid = 0
    for row in best:
        if not (row.speedup or 0) > 1:
            break
        paid = row.requests
    return paid


def per_batch_size_schedule(best: list[ConcurrencyRow]) -> list[list[int]] | None:
    """vLLM's `num_speculative_tokens_per_batch_size` (inclusive batch-size ranges and their K; 0 = no drafts)
    from the measured concurrencies: each range runs the K that was fastest at the concurrency it holds (0 where
    plain decoding was faster), split at the geometric middle between measured concurrencies; vLLM carries the
    last K on to larger batches. None when one K serves every measured concurrency (set num_speculative_tokens)
    or speculation loses already at batch 1 (serve without it)."""
    if not best or best[0].requests != 1 or not (best[0].speedup or 0) > 1:
        return None
    ks = [row.k if (row.speedup or 0) > 1 else 0 for row in best]
    if len(set(ks)) == 1:
        return None
    cs = [row.requests for row in best]
    ends = [math.isqrt(a * b) for a, b in zip(cs, cs[1:])] + [cs[-1]]
    schedule: list[list[int]] = []
    for start, end, k in zip([1] + [e + 1 for e in ends], ends, ks):
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = end
        else:
            schedule.append([start, end, k])
    return schedule


def free_speculator(runs: list[dict[str, Any]], natural: dict[str, EngineOutput], greedy: bool
                    ) -> tuple[list[KRow], SpeculatorEntry | None]:
    """The rows of one speculator timed beside the drafter (the engine's model-free prompt lookup and suffix
    decoding, or the baseline drafter), a row per K timed (its lossless check: its mismatches counted), and its entry:
    the fastest K at batch 1, with every K's rows at each concurrency (None where none ran)."""
    rows = [replace(k_row(r, natural, greedy), engine_args=r["llm_kwargs"]["speculative_config"]) for r in runs]
    if not rows:
        return rows, None
    together = concurrency_rows(rows, runs)
    return rows, SpeculatorEntry(**fields_of(fastest_at_batch_1(rows)), concurrency=together,
                                 pays_up_to_concurrency=pays_up_to(best_per_concurrency(together)))


def ranking(drafter: KRow, lookup: KRow | None, suffix: KRow | None, combined: CombinedEntry | None = None,
            baseline: KRow | None = None) -> list[RankRow]:
    """The drafter, the baseline drafter, prompt lookup, suffix decoding and the combined speculator at each one's
    fastest K (the combined one at combined_entry's, the baseline drafter at the one K it was timed at), fastest first
    at batch 1 (by the engine's speedup over plain decoding on the same prompts), with tau and the intervals: what to
    serve."""
    named = [(name, row) for name, row in (("drafter", drafter), ("baseline drafter", baseline),
                                           ("prompt lookup", lookup), ("suffix decoding", suffix),
                                           (combined and parse_combined(combined.setting).name, combined)) if row]
    shared = set.intersection(*({p.id for p in row.per_prompt} for _, row in named))
    rows = [replace(on_prompts(row, shared), speculator=name) for name, row in named]
    return sorted(rows, key=lambda r: -(r.speedup if math.isfinite(r.speedup or math.nan) else -1.0))


def on_prompts(row: KRow, ids: set[str]) -> RankRow:
    """A K row's ranking figures on the prompts `ids` of those it timed, and how many (`prompts`). All of them: the
    row's own figures. Fewer (another speculator timed only the first prompts: eval --free-limit): recomputed on
    those, so that the ranking compares every speculator on the same prompts: the engine's speedup (timing_figures:
    the sum of plain_core_s over the sum of spec_core_s) with its bootstrap interval, tau_per_prompt (the mean of
    the prompts' taus), and tau_steps (with its interval) pooled over the prompts' verification steps as
    sum(committed) / sum(committed / tau), committed = new_tokens - 1 per prompt (the first token is the
    prefill's): a prompt's tau is its committed tokens over its steps, so committed / tau is its steps and this
    pools them exactly as the row's own tau_steps does. (Exactly where every step commits its tau, 1 + its accepted
    drafts; an output's last step cut short by a stop token or the length limit still counts the drafts past the
    cut in its tau, engine.jobs.engine_steps, and there committed / tau falls short of the steps by a fraction of
    one: a TimedPrompt keeps no step count.) lossless_mismatches stays the row's own, over every prompt it timed."""
    picked = [p for p in row.per_prompt if p.id in ids]
    if len(picked) == len(row.per_prompt):
        return RankRow(k=row.k, tau_steps=row.tau_steps, tau_steps_interval=row.tau_steps_interval,
                       tau_per_prompt=row.tau_per_prompt, speedup=row.speedup, speedup_interval=row.speedup_interval,
                       lossless_mismatches=row.lossless_mismatches, prompts=len(picked))
    stepped = [p for p in picked if p.tau is not None]  # a prompt without a verification step has no tau
    committed = [p.new_tokens - 1 for p in stepped]
    pooled = ratio_of_sums(committed, [c / p.tau for c, p in zip(committed, stepped)])
    speed = timing_figures(picked)
    return RankRow(k=row.k, tau_steps=pooled(list(range(len(stepped)))),
                   tau_steps_interval=bootstrap_interval(pooled, len(stepped)),
                   tau_per_prompt=sum(p.tau for p in stepped) / len(stepped) if stepped else None,
                   speedup=speed.speedup, speedup_interval=speed.speedup_interval,
                   lossless_mismatches=row.lossless_mismatches, prompts=len(picked))


def engine_eval(cfg: EvalConfig, target: Target, prompts: dict[str, list[int]], block_size: int, dtype_name: str,
                device: str, workdir: Path, expected_tau: tuple[str, list[float]] | None = None,
                constraints: dict[str, dict[str, Any] | None] | None = None) -> VllmEval:
    """What users buy, measured in vLLM: plain decoding and the drafter folder as vLLM's `dflash` speculator at
    each speculation length K (`--speculative-tokens`, else `k_sweep_order` as far as `--sweep-budget-s`
    affords, first the shortest K that keeps the best tau by `expected_tau` (its source, tau at each K):
    sweep_first_k), timed by engine.child._timed (fixed lengths, warm, interleaved, engine core and stopwatch),
    at batch 1 and at `--concurrency`. Per K: tau and acceptance by position, tokens/s and the speedup by both
    clocks with bootstrap intervals over prompts, the lossless check (greedy: speculative token ids equal plain
    ones, prompt by prompt). The fastest K at batch 1 is best_k: the entry's headline figures (what push's gate and
    the card read) are its own, and its mismatches in a low-precision dtype are rerun in fp32 through the engine.
    Plain decoding's own speed over the sweep (plain_rates) says whether the machine held still while it measured.
    With --baseline-drafter (one: the command's check) the baseline drafter is timed at the first K beside the
    drafter, on plain decoding's same runs (`baseline`, its mismatches counted; the fp32 recheck stays best_k's),
    and the drafter's row at that K is paired with it by prompt (`against_baseline`: paired_against). Every figure
    is over the prompts no engine run refused (`taken`), computed once the runs have ended (the
    combined speculator's rule and K from the figures before its run) and again where an fp32 recheck refused a
    prompt they held."""
    from dflash_train.model.checkpoint import drafter_identity

    drafter_sha256 = drafter_identity(Path(cfg.drafter))["sha256"]  # the drafter as the engine is about to read it
    source, tau_by_k = expected_tau or (None, None)
    first, ks = sweep_plan(cfg, block_size, tau_by_k)
    max_len = max(len(ids) for ids in prompts.values()) + cfg.max_new_tokens + block_size
    run = EngineRunner(cfg, target, device, workdir, prompts, constraints or {}, max_len, first, source)
    baseline_sha256 = check_baseline(run.baseline, ks[0])
    job, result = run(prompts, dtype_name, "timed", ks, cfg.concurrency, cfg.sweep_budget_s)
    natural, greedy = result.by_id(), cfg.temperature == 0
    drafted = [r for r in result.timed["runs"] if r.get("method", "dflash") == "dflash"]
    free = {method: [r for r in result.timed["runs"] if r.get("method") == method]
            for method in (*LOOKUP_METHODS, "baseline")}
    seconds = result.load_s + result.wall_s

    def rows() -> tuple[list[KRow], dict[str, tuple[list[KRow], SpeculatorEntry | None]]]:
        """The drafter's row per K; prompt lookup's, suffix decoding's and the baseline drafter's rows and entries by
        method ("ngram", "suffix", "baseline"); each over the prompts no engine run has refused so far (`taken`)."""
        return ([k_row(taken(r, run.refused), natural, greedy) for r in drafted],
                {method: free_speculator([taken(r, run.refused) for r in timed], natural, greedy)
                 for method, timed in free.items()})

    rule = combined_timed = None
    if cfg.combined:
        sweep, beside = rows()
        (_, lookup), (_, suffix) = beside["ngram"], beside["suffix"]
        best = fastest_at_batch_1(sweep)
        rule = combined_rule(cfg.combined, best, lookup)
        longest = max(best.k, rule.k, suffix.k if suffix and rule.suffix is not None else 0)
        combined_timed, seconds_combined = combined_run(run, job, natural, rule, min(longest, block_size - 1))
        seconds += seconds_combined
    while True:  # until no fp32 recheck refuses a prompt the figures hold
        known = len(run.refused)
        sweep, beside = rows()
        (lookup_rows, lookup), (suffix_rows, suffix), (baseline_rows, baseline) = (
            beside["ngram"], beside["suffix"], beside["baseline"])
        best = fastest_at_batch_1(sweep)
        best_run = {r["k"]: r for r in drafted}[best.k]
        mismatches = lossless_at_best_k(run, best, best_run, natural, dtype_name)
        combined = combined_entry(run, combined_timed, natural, rule, dtype_name) if rule else None
        if len(run.refused) == known:
            break
    if combined:  # what it is worth against each of the others at its own fastest K, paired by prompt
        combined = replace(combined, against={
            name: paired_against(combined, other) for name, other in
            (("drafter", best), ("prompt lookup", lookup), ("suffix decoding", suffix)) if other})
    # the drafter at the baseline drafter's K (its first, always timed) against it, paired by prompt
    at_k = next((row for row in sweep if baseline and row.k == baseline.k), None)
    against_baseline = paired_against(at_k, baseline) if at_k and baseline else None
    together = concurrency_rows(sweep, drafted)
    fastest = best_per_concurrency(together)
    return VllmEval(
        **fields_of(best.acceptance(), best.speed(),
                    lossless_entry(best, mismatches, run.recheck_s.get(None), greedy, dtype_name)),
        # refused_by_engine: the prompts left out of every run and comparison, id -> the engine's reason
        version=result.version, refused_by_engine=dict(run.refused), best_k=best.k,
        best_k_share=best_k_share(sweep, best.k), tokens_unaccounted_by_steps=best.tokens_unaccounted_by_steps,
        drafter_sha256=drafter_sha256, dtype=dtype_name, engine_args=best_run["llm_kwargs"],
        engine_args_plain=result.llm_kwargs, serve_command=serve_command(best_run["llm_kwargs"]),
        load_s=LoadSeconds(plain=result.load_s, speculative=best_run["load_s"]), environment=result.environment,
        sweep=sweep, concurrency=together, concurrency_best=fastest, pays_up_to_concurrency=pays_up_to(fastest),
        per_batch_size_schedule=per_batch_size_schedule(fastest), ngram=lookup, ngram_sweep=lookup_rows,
        suffix=suffix, suffix_sweep=suffix_rows, combined=combined, baseline=baseline, baseline_sha256=baseline_sha256,
        against_baseline=against_baseline, ranking=ranking(best, lookup, suffix, combined, baseline),
        timing=timing_entry(run, result, seconds, natural, sweep, lookup_rows, suffix_rows,
                            [combined] if combined else [], baseline_rows),
        per_prompt=best.per_prompt)


def check_baseline(folder: str | None, k: int) -> str | None:
    """The baseline drafter's sha256 as the engine is about to read it (checkpoint.drafter_identity), after checking
    that its block holds the K it is timed at (the drafter's first); None without one."""
    from dflash_train.model.checkpoint import drafter_identity, read_config

    if folder is None:
        return None
    if k > (room := read_config(folder).block_size - 1):
        raise UserError(f"--baseline-drafter {folder}: its block holds K up to {room}, and vLLM times it at the "
                        f"drafter's first K = {k}: pass --speculative-tokens with a first K of at most {room}")
    return drafter_identity(Path(folder))["sha256"]


def sweep_plan(cfg: EvalConfig, block_size: int, tau_by_k: list[float] | None) -> tuple[int | None, list[int]]:
    """The sweep's first K (sweep_first_k by the expected tau at each K and --step-cost; None with
    --speculative-tokens) and the K to time, in order (--speculative-tokens, else k_sweep_order up to B - 1)."""
    first = None if cfg.speculative_tokens else sweep_first_k(tau_by_k, cfg.step_cost)
    ks = cfg.speculative_tokens or k_sweep_order(block_size - 1, first)
    if too_long := [k for k in ks if k > block_size - 1]:
        raise UserError(f"--speculative-tokens {too_long[0]} is more than the verify block holds (B - 1 = "
                        f"{block_size - 1}: the drafter's block size, or --block-size)")
    return first, ks


def paired_against(row: KRow, other: KRow) -> Paired:
    """`row` against `other` on the prompts both timed (with a tau), paired by prompt: each side's mean tau, the
    ratio of their mean taus and of their speedups over plain decoding (each a ratio of sums, engine core), each
    with its 95% bootstrap interval over the same resampled prompts."""
    theirs = {p.id: p for p in other.per_prompt if p.tau is not None}
    pairs = [(p, theirs[p.id]) for p in row.per_prompt if p.id in theirs and p.tau is not None]

    def total(idx: list[int], side: int, value: Callable[[TimedPrompt], float]) -> float:
        return sum(value(pairs[i][side]) for i in idx)

    def tau_ratio(idx: list[int]) -> float | None:
        return total(idx, 0, lambda p: p.tau) / total(idx, 1, lambda p: p.tau) if idx else None

    def speedup_ratio(idx: list[int]) -> float | None:
        if not idx:
            return None
        plain, spec = (lambda p: p.plain_core_s), (lambda p: p.spec_core_s)
        return (total(idx, 0, plain) / total(idx, 0, spec)) / (total(idx, 1, plain) / total(idx, 1, spec))

    def mean_tau(side: int) -> float | None:
        return total(everything, side, lambda p: p.tau) / len(pairs) if pairs else None

    everything = list(range(len(pairs)))
    return Paired(prompts=len(pairs), k=other.k, tau=mean_tau(0), tau_other=mean_tau(1),
                  tau_ratio=tau_ratio(everything),
                  tau_ratio_interval=bootstrap_interval(tau_ratio, len(pairs)),
                  speedup_ratio=speedup_ratio(everything),
                  speedup_ratio_interval=bootstrap_interval(speedup_ratio, len(pairs)))


def combined_rule(option: str, drafter: KRow, lookup: KRow | None) -> CombinedRule:
    """--combined's rule: as given, or for "on" the one for the drafter's and prompt lookup's tau_steps at their fastest
    K (CombinedRule.for_taus; the default where lookup was not timed), with the suffix tree as a source at
    SUFFIX_SCORE where arctic-inference loads (else without it, and one line says why)."""
    rule = parse_combined(option)
    if option.strip() != "on":
        return rule
    if (why_not := suffix_problem()) is not None:
        print(f"engine: the combined speculator without the suffix tree: {why_not}", flush=True)
    suffix = SUFFIX_SCORE if why_not is None else None
    if lookup is None:
        return replace(rule, suffix=suffix)
    return CombinedRule.for_taus(drafter.tau_steps, lookup.tau_steps, rule.k, suffix)


def combined_run(run: EngineRunner, job: EngineJob, natural: dict[str, EngineOutput], rule: CombinedRule, k: int
                 ) -> tuple[dict[str, Any], float]:
    """The combined speculator (spec_decode.combined: the drafter, and the suffix tree's or prompt lookup's block where
    the rule picks it) at K (the longest of the drafter's fastest K, the rule's k and, with the suffix tree,
    suffix decoding's fastest K, within the drafter's block: a shorter K would cut the free blocks), timed as the
    drafter was, in an engine process of its own, on the same prompts at their lengths: its timed run, and its
    seconds."""
    setting = rule.setting()
    print(f"engine: vLLM, plain and the combined speculator ({setting}) at K = {k} "
          f"({len(natural.keys() - run.refused.keys())} prompts at their lengths above)", flush=True)
    t0 = time.perf_counter()
    again = run.engine(replace(free_job(job, natural, [("combined", k)]), combined=setting), "combined",
                       "vLLM with the combined speculator")
    (timed,) = again.timed["runs"]
    return timed, time.perf_counter() - t0


def combined_entry(run: EngineRunner, timed: dict[str, Any], natural: dict[str, EngineOutput], rule: CombinedRule,
                   dtype_name: str) -> CombinedEntry:
    """The combined speculator's entry from its timed run (combined_run), over the prompts no engine run has refused
    so far (`taken`): its blocks by source (summed over the prompts), its lossless check (a mismatch rerun in fp32 as
    the drafter's)."""
    greedy, setting, timed = run.cfg.temperature == 0, rule.setting(), taken(timed, run.refused)
    row = k_row(timed, natural, greedy)
    sources: dict[str, dict[str, int]] = {}
    for out in timed["outputs"]:
        for source, count in (out.get("sources") or {}).items():
            for key, n in count.items():
                sources.setdefault(source, {}).setdefault(key, 0)
                sources[source][key] += n
    mismatches = lossless_at_best_k(run, row, timed, natural, dtype_name, setting)
    lossless = lossless_entry(row, mismatches, run.recheck_s.get(setting), greedy, dtype_name)
    return CombinedEntry(
        **{**fields_of(row), **fields_of(lossless), "engine_args": timed["llm_kwargs"]},
        concurrency=concurrency_rows([row], [timed]), setting=setting,
        sources={source: SourceCount(**count) for source, count in sources.items()},
        # per prompt in order, the answers its suffix tree held before it: the warm-up's and the earlier prompts'
        # (the engine's own), never a held-out answer it had not produced yet
        suffix_answers_before=[out.get("suffix_answers_before") for out in timed["outputs"]])


def lossless_at_best_k(run: EngineRunner, best: KRow, best_run: dict[str, Any], natural: dict[str, EngineOutput],
                       dtype_name: str, combined: str | None = None) -> list[Mismatch]:
    """The prompts whose output at best_k differs from plain decoding's, each diagnosed (diagnose_mismatch); in a
    low-precision dtype they are rerun in fp32 through the engine (the lossless check alone), which says whether
    each was rounding (with `combined`, a rule setting: the combined speculator's). Each prompt is rerun once at a
    K (`run.rechecked`, its seconds in `run.recheck_s`); one that rerun refuses leaves every comparison
    (engine_eval computes the figures again), and this list."""
    spec = {o["id"]: o["token_ids"] for o in best_run["outputs"]}
    mismatches = [diagnose_mismatch(run.target, run.prompts[p.id], natural[p.id].token_ids, spec[p.id], p.id)
                  for p in best.per_prompt if p.mismatch]
    if not mismatches or dtype_name == "fp32":
        return mismatches
    todo = {d.id: run.prompts[d.id] for d in mismatches if (combined, best.k, d.id) not in run.rechecked}
    if todo:
        t0 = time.perf_counter()
        _, again = run(todo, "fp32", "fp32" if combined is None else "fp32-combined", [best.k], [], None, "check",
                       combined)
        spec32, plain32 = {o["id"]: o["token_ids"] for o in again.timed["runs"][0]["outputs"]}, again.by_id()
        run.rechecked |= {(combined, best.k, rid): spec32[rid] == plain.token_ids for rid, plain in plain32.items()}
        run.recheck_s[combined] = run.recheck_s.get(combined, 0.0) + time.perf_counter() - t0
    for d in mismatches:
        d.fp32_spec_equals_plain = run.rechecked.get((combined, best.k, d.id))
    return [d for d in mismatches if d.id not in run.refused]


def lossless_entry(best: KRow, mismatches: list[Mismatch], recheck_s: float | None, greedy: bool,
                   dtype_name: str) -> Lossless:
    """The entry's lossless check at best_k: prompts checked, mismatches, those the fp32 rerun did not resolve."""
    return Lossless(
        lossless_checked=best.lossless_checked, lossless_mismatches=len(mismatches) if greedy else None,
        lossless_mismatches_fp32=(sum(not d.fp32_spec_equals_plain for d in mismatches)
                                  if mismatches and dtype_name != "fp32" else None),
        lossless_recheck_s=recheck_s, mismatches=mismatches,
        lossless_note=None if greedy else "not checked: at temperature > 0 vLLM's rejection sampler keeps the "
                                          "target's distribution, not its tokens")


def timing_entry(run: EngineRunner, result: EngineResult, seconds: float, natural: dict[str, EngineOutput],
                 sweep: list[KRow], lookup_rows: list[KRow], suffix_rows: list[KRow],
                 combined_rows: list[CombinedEntry], baseline_rows: list[KRow] | None = None) -> SweepTiming:
    """How the sweep was timed (the entry's `timing`): the protocol, the K measured and those the budget left out,
    the first K and the estimate that chose it, plain decoding's own speed in the reference pass and in each row's
    runs and how far apart they are (host_drift; above HOST_DRIFT_LIMIT the machine's speed changed while it
    measured), the engine's seconds and the load average at the end."""
    baseline_rows = baseline_rows or []
    rates = plain_rates(natural, sweep + lookup_rows + suffix_rows + combined_rows + baseline_rows)
    labels = ["reference", *(str(r.k) for r in sweep), *(f"prompt lookup {r.k}" for r in lookup_rows),
              *(f"suffix decoding {r.k}" for r in suffix_rows),
              *(f"{parse_combined(r.setting).name} {r.k}" for r in combined_rows),
              *(f"baseline drafter {r.k}" for r in baseline_rows)]
    drift = host_drift(rates)
    idle = idle_s(torch.device(run.device).type)
    wait = (f"{idle:g} s after the last (the idle engine stops polling)" if idle else
            "right after the last (on CPU no idle engine polls)")
    return SweepTiming(
        protocol=TIMING_PROTOCOL.format(idle=wait), repeats=run.cfg.repeats, budget_s=run.cfg.sweep_budget_s,
        measured_k=[row.k for row in sweep], skipped_k=result.timed["skipped"],
        first_k=None if run.first is None else FirstK(k=run.first, source=run.source, slack=SWEEP_FIRST_SLACK,
                                                      step_cost=run.cfg.step_cost),
        plain_tokens_per_s_decode=dict(zip(labels, rates)), host_drift=drift, host_drift_limit=HOST_DRIFT_LIMIT,
        host_unsteady=drift is not None and drift > HOST_DRIFT_LIMIT, concurrency=[1, *run.cfg.concurrency],
        seconds=seconds, load_average_after=[round(x, 2) for x in os.getloadavg()])
