"""Markdown tables of an eval report (report.json), one rendering for every reader: the eval's report.md, the model
card, the demo and the serving benchmarks. vLLM's speculation-length sweep (batch 1), its concurrency runs, the
ranking of the speculators, the line on constrained traffic, and the formatting they share (`fmt`, `with_interval`,
`table`). A service: it reads the report's records (dflash_train.eval_report) and imports no stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflash_train.eval_report import (CombinedEntry, ConstraintsSummary, KRow, Machine, Paired, SpeculatorEntry,
                                      SweepTiming, VllmEval)
from dflash_train.spec_decode.lookup import COMBINED_SETTING, CombinedRule, parse_combined


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else "—"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.3g}"
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v) for v in value) if value else "[]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def with_interval(value: Any, interval: Any) -> str:
    """1.35 [1.22, 1.48]: a figure and its 95% bootstrap interval over prompts (where there is one)."""
    ok = isinstance(interval, (list, tuple)) and len(interval) == 2
    return fmt(value) + (f" [{fmt(interval[0])}, {fmt(interval[1])}]" if ok else "")


def describe_machine(info: Machine | None, dtype: Any = None) -> str:
    """An eval's `settings.machine` in words: 'AMD EPYC 9R14 (2 cores), bf16, load average 3.1 at the start'."""
    if info is None:
        return "an unrecorded machine" + (f", {dtype}" if dtype else "")
    words = f"{fmt(info.cpu)} ({fmt(info.cores)} cores)" + (f", GPU {fmt(info.gpu)}" if info.gpu else "")
    return words + (f", {dtype}" if dtype else "") + (f", load average {fmt(info.load_average[0])} at the start"
                                                       if info.load_average else "")


def serving_tables(engine: VllmEval, machine: Machine | None) -> list[str]:
    """vLLM's speculation-length table (batch 1) and concurrency table from an eval report's `vllm`: the chosen K,
    how far speculation pays, vLLM's per-batch-size setting, and on what they were measured. One rendering for
    report.md and the model card."""
    if not engine.sweep:
        return []
    timing = engine.timing or SweepTiming()
    lines = ["Speculation length K (`num_speculative_tokens`), one request at a time; τ (over all steps) and "
             "speedups with 95% bootstrap intervals over prompts; tokens/s of whole requests (every new token, "
             "prefill included), by the engine core (from the request's arrival to its last token) and by a "
             "stopwatch around each:", "", sweep_table(engine), "", best_k_line(engine, timing)]
    if first := timing.first_k:  # under best_k's line, not the ranking's table
        cost = first.step_cost
        lines[-1] += (f" Timed first: K = {fmt(first.k)}, the shortest whose expected "
                      + (f"speed (tau by the {first.source} over a step's cost of {cost[0]:.2f} + {cost[1]:.3f} "
                         f"x K plain decoding steps, as measured on this machine)" if cost else
                         f"tau by the {first.source}")
                      + f" is within {fmt(100 * first.slack)}% of the best.")
    lines += ranking_lines(engine)
    lines += host_drift_lines(engine)
    lines += concurrency_table(engine)
    lines += ["", f"Measured on {describe_machine(machine, engine.dtype)}"
              + (f" ({fmt(timing.load_average_after[0])} at the end)" if timing.load_average_after else "")
              + f", vLLM {fmt(engine.version)}: {fmt(timing.protocol)}; "
              f"{fmt(timing.repeats)} timed run(s) per prompt and side. Tokens/s and the best K are a "
              f"measurement of this machine: on another one, measure again (`dflash-train eval`)."]
    return lines


def sweep_table(engine: VllmEval) -> str:
    """One row per K timed at batch 1: the drafter's (best_k in bold), then prompt lookup's and suffix decoding's,
    then the combined speculator, then the baseline drafter."""
    by_k = lambda rows: sorted(rows, key=lambda r: r.k)  # noqa: E731
    labelled: list[tuple[str, KRow]] = [(f"**{r.k}**" if r.k == engine.best_k else fmt(r.k), r)
                                        for r in by_k(engine.sweep)]
    labelled += [(f"{fmt(r.k)}, prompt lookup", r) for r in by_k(engine.ngram_sweep)]
    labelled += [(f"{fmt(r.k)}, suffix decoding", r) for r in by_k(engine.suffix_sweep)]
    if combined := engine.combined:
        labelled.append((f"{fmt(combined.k)}, {combined_name(combined)}", combined))
    if baseline := engine.baseline:
        labelled.append((f"{fmt(baseline.k)}, baseline drafter", baseline))
    rows = [(label, with_interval(r.tau_steps, r.tau_steps_interval),
             f"{fmt(r.tokens_per_s_baseline)} / {fmt(r.tokens_per_s)}",
             with_interval(r.speedup, r.speedup_interval) + "×",
             f"{fmt(r.tokens_per_s_baseline_wall)} / {fmt(r.tokens_per_s_wall)}",
             with_interval(r.speedup_wall, r.speedup_wall_interval) + "×",
             f"{fmt(r.lossless_mismatches)} of {fmt(r.lossless_checked)}")
            for label, r in labelled]
    return table(rows, ("K", "τ", "Tokens/s plain / speculative", "Speedup", "Stopwatch: tokens/s plain / "
                        "speculative", "Stopwatch: speedup", "Lossless mismatches"))


def best_k_line(engine: VllmEval, timing: SweepTiming) -> str:
    """The line under the K table: best_k, how often the resampled prompts pick it, the K the time budget left out;
    prompt lookup and suffix decoding against the drafter, and how to serve the one of them that is faster; the
    combined speculator and the baseline drafter, each against the others paired by prompt."""
    best_k, share, skipped = engine.best_k, engine.best_k_share, timing.skipped_k
    line = (f"best_k = {fmt(best_k)}: the fastest at batch 1"
            + (f" (in {share:.0%} of the bootstrap resamples of the prompts)" if isinstance(share, float) else "")
            + (f"; not measured within the time budget ({fmt(timing.budget_s)} s): K = {fmt(skipped)}"
               if skipped else "") + ".")
    if lookup := engine.ngram:
        mine = next((r for r in engine.sweep if r.k == best_k), KRow())
        config = lookup.engine_args or {}
        looked = engine.ngram_sweep
        line += (f" Prompt lookup: vLLM's own `ngram` speculator, no model (the tokens that followed an earlier "
                 f"occurrence of the context's last n tokens, n from {fmt(config.get('prompt_lookup_max'))} "
                 f"down to {fmt(config.get('prompt_lookup_min'))}), timed the same way on the same prompts: "
                 f"the baseline a drafter has to beat: {fmt(lookup.speedup)}× at K = {fmt(lookup.k)}"
                 + (f" (the fastest of K = {', '.join(fmt(r.k) for r in sorted(looked, key=lambda r: r.k))})"
                    if len(looked) > 1 else "") + f" against the drafter's {fmt(mine.speedup)}× at best_k.")
    if suffix := engine.suffix:
        line += (f" Suffix decoding: vLLM's `suffix` speculator, no model (drafts from a suffix tree over the "
                 f"prompt and the answers the engine gave before), timed the same way: "
                 f"{fmt(suffix.speedup)}× at K = {fmt(suffix.k)}.")
    if engine.combined:
        line += " " + combined_line(engine.combined)
    if engine.baseline:
        line += " " + baseline_line(engine.baseline, engine.against_baseline)
    if (served := speculator_to_serve(engine)) is not None:  # what to serve: the fastest of them
        line += f" {served.name[0].upper()}{served.name[1:]} is the fastest here: " + (
            f"serve it with `--speculative-config '{json.dumps(served.config, separators=(',', ':'))}'` in "
            f"place of the drafter's." if not served.environment else
            f"serve the drafter as below with `{served.environment}` set and dflash-train installed beside vLLM "
            f"(its plugin).")
    return line


def combined_name(combined: CombinedEntry) -> str:
    """The combined speculator's sources, from its entry's setting ("drafter + prompt lookup" where unreadable)."""
    try:
        return parse_combined(combined.setting).name
    except ValueError:
        return CombinedRule().name


def combined_line(combined: CombinedEntry) -> str:
    """What the combined speculator did: its speedup and tau at its K, and its blocks by source."""
    sources = combined.sources
    blocks = {s: c.blocks for s, c in sources.items()}
    kept = ", ".join(f"{fmt(c.accepted)} of {fmt(c.drafted)} drafts kept from {s}" for s, c in sources.items())
    total = sum(blocks.values())
    unasked = sum(c.without_drafter for c in sources.values())
    free = [s for s in ("suffix", "lookup") if blocks.get(s)]
    with_suffix = "suffix" in combined_name(combined)
    return (f"The combined speculator (this package's vLLM plugin: the drafter, "
            + ("the suffix tree's block (over the prompt and the answers this engine gave before) where its own "
               "score reaches the rule's `suffix`, else " if with_suffix else "and ")
            + "prompt lookup's block where lookup matched and the drafter's first draft is less likely than the "
              "rule says (at confidence 1: wherever lookup matched); a step whose blocks need no drafter skips its "
              f"pass; `{combined.setting}`), timed the same way at K = {fmt(combined.k)}: "
            f"{fmt(combined.speedup)}×, τ {fmt(combined.tau_steps)}"
            + (f"; of {fmt(total)} blocks " + ", ".join(f"{fmt(blocks[s])} came from {s}" for s in free)
               + (f", {fmt(unasked)} at steps that skipped the drafter's pass" if unasked else "")
               + f" ({kept})" if total and free else "")
            + "".join(f"; {paired_words(('the ' if name == 'drafter' else '') + name, vs)}"
                      for name, vs in combined.against.items())
            + ".")


def paired_words(other: str, vs: Paired) -> str:
    """One speculator against `other` (its name in prose), paired by prompt (a `Paired`): the ratios of their τ per
    prompt and of their speedups, each with its 95% interval."""
    return (f"against {other} at K = {fmt(vs.k)}, paired by prompt: τ per prompt "
            f"{with_interval(vs.tau_ratio, vs.tau_ratio_interval)}×, speedup "
            f"{with_interval(vs.speedup_ratio, vs.speedup_ratio_interval)}×")


def baseline_line(baseline: SpeculatorEntry, against: Paired | None) -> str:
    """The baseline drafter (eval --baseline-drafter), timed the same way at the drafter's first K, and the drafter
    there against it, paired by prompt (the entry's `against_baseline`)."""
    return (f"The baseline drafter (`--baseline-drafter`), timed the same way on the same plain runs at K = "
            f"{fmt(baseline.k)}: {fmt(baseline.speedup)}×, τ {fmt(baseline.tau_steps)}, "
            f"{fmt(baseline.lossless_mismatches)} of {fmt(baseline.lossless_checked)} outputs differing from plain "
            f"decoding" + (f"; the drafter {paired_words('it', against)}" if against else "") + ".")


def host_drift_lines(engine: VllmEval) -> list[str]:
    """The warning where plain decoding's own speed moved while the sweep measured (the entry's
    timing.host_unsteady); [] on a steady machine."""
    timing = engine.timing
    if not (timing and timing.host_unsteady):
        return []
    rates = [v for v in timing.plain_tokens_per_s_decode.values() if isinstance(v, (int, float))]
    runs = ("the K's runs" + (" and prompt lookup's" if engine.ngram else "")
            + (" and suffix decoding's" if engine.suffix else "")
            + (" and the baseline drafter's" if engine.baseline else ""))
    return ["", f"**The machine's speed changed while it was measured**: plain decoding ran at "
                f"{min(rates):.1f} to {max(rates):.1f} tokens/s (decode phase) over the reference pass and "
                f"{runs}, {timing.host_drift:.0%} apart, on the same prompts at the same lengths. "
                f"A speedup here can be off by about as much, and K measured at different times are not "
                f"comparable: measure again on a quiet machine (`--repeats 2` pairs each prompt twice)."]


def constraints_markdown(c: ConstraintsSummary | None) -> list[str]:
    """The report's and the card's line on constrained traffic: what share of the prompts was decoded under
    their requests' own constraints, of which kinds, and what was left out."""
    if c is None or not c.constrained:
        return []
    kinds = ", ".join(f"{fmt(n)} {kind}" for kind, n in c.by_kind.items() if kind != "none")
    left = [f"{fmt(n)} without their {key}" for key, n in c.decoded_without.items() if n]
    share = f" ({100 * c.constrained / c.of:.0f}%)" if c.of > 0 else ""
    return [f"Constrained traffic: {c.constrained} of {fmt(c.of)} prompts{share} decoded under their "
            f"requests' own constraints ({kinds}; 'settings': stop strings, penalties and the like), plain and "
            f"speculative alike" + (f"; {', '.join(left)} (vLLM refuses them with speculative decoding)" if left
                                    else "") + ".", ""]


@dataclass(frozen=True)
class Serve:
    """A speculator to serve instead of the drafter alone: its vLLM speculative config, and for the combined one
    the environment setting that turns its plugin on."""
    name: str
    k: int
    speedup: float
    config: dict[str, Any]
    environment: str | None = None


def speculator_to_serve(engine: VllmEval) -> Serve | None:
    """The speculator to serve instead of the drafter alone, or None: vLLM's prompt lookup (the entry's `ngram`),
    suffix decoding (`suffix`), each at its fastest K, or the combined speculator (`combined`, at its K),
    where the fastest of them beat the drafter at best_k one request at a time (the entry's headline speedup)."""
    best = None
    for name, entry in beside_the_drafter(engine):
        if (entry.speedup or 0) > max(engine.speedup or 0, best.speedup if best else 0):
            best = Serve(name, entry.k, entry.speedup or 0, entry.engine_args or {},
                         f"{COMBINED_SETTING}={entry.setting}" if isinstance(entry, CombinedEntry) else None)
    return best


def beside_the_drafter(engine: VllmEval) -> list[tuple[str, SpeculatorEntry]]:
    """The speculators an eval timed beside the drafter, by their names in prose."""
    return [(name, entry) for name, entry in (("prompt lookup", engine.ngram), ("suffix decoding", engine.suffix),
                                              ("the combined speculator", engine.combined)) if entry]


def ranking_lines(engine: VllmEval) -> list[str]:
    """The drafter, the baseline drafter, prompt lookup, suffix decoding and the combined speculator ranked at their
    own fastest K (the baseline drafter at the one K it was timed at; the entry's `ranking`), when more than one of
    them ran."""
    if len(engine.ranking) < 2:
        return []
    rows = [(str(i), r.speculator, fmt(r.k), with_interval(r.tau_steps, r.tau_steps_interval),
             with_interval(r.speedup, r.speedup_interval) + "×", fmt(r.lossless_mismatches))
            for i, r in enumerate(engine.ranking, 1)]
    prompts = {r.prompts for r in engine.ranking}
    on = f"the same {prompts.pop()} prompts" if len(prompts) == 1 and None not in prompts else "the same prompts"
    at = "each at its own fastest K" + (" (the baseline drafter at the one K it was timed at)" if engine.baseline
                                        else "")
    return ["", f"Ranked by speed one request at a time, {at}, on {on}:", "",
            table(rows, ("Rank", "Speculator", "K", "τ", "Speedup", "Lossless mismatches"))]


def concurrency_table(engine: VllmEval) -> list[str]:
    """The eval's runs of several requests decoded together, the drafter's K, prompt lookup's (its `ngram` entry)
    and the baseline drafter's side by side at each concurrency, and how far each pays; [] where none ran."""
    if not any(r.requests != 1 for r in engine.concurrency):
        return []
    looked = engine.ngram.concurrency if engine.ngram else []
    baseline = engine.baseline.concurrency if engine.baseline else []
    best = {(r.requests, r.k) for r in engine.concurrency_best}
    labelled = [(f"**{r.k}**" if (r.requests, r.k) in best else fmt(r.k), r) for r in engine.concurrency]
    labelled += [(f"{fmt(r.k)}, prompt lookup", r) for r in looked]
    labelled += [(f"{fmt(r.k)}, baseline drafter", r) for r in baseline]
    rows = [(fmt(r.requests), label, f"{fmt(r.tokens_per_s_baseline)} / {fmt(r.tokens_per_s)}",
             f"{fmt(r.speedup)}×", f"{fmt(r.tokens_per_s_baseline_wall)} / {fmt(r.tokens_per_s_wall)}",
             f"{fmt(r.speedup_wall)}×")
            for label, r in sorted(labelled, key=lambda lr: lr[1].requests)]  # stable: lookup, baseline last
    schedule = engine.per_batch_size_schedule

    def pays(who: str, paid: Any) -> str:
        return (f"{who} does not pay here, even one request at a time." if not paid else
                f"{who} pays one request at a time only." if paid == 1 else
                f"{who} pays up to {fmt(paid)} requests decoded together (of those measured).")
    return ["", "Requests decoded together (the drafter's fastest K at each in bold; tokens/s of all requests):", "",
            table(rows, ("Requests", "K", "Tokens/s plain / speculative", "Speedup",
                         "Stopwatch: tokens/s plain / speculative", "Stopwatch: speedup")), "",
            pays("Speculation", engine.pays_up_to_concurrency)
            + (f" The fastest K per batch size as vLLM's `num_speculative_tokens_per_batch_size` (inclusive "
               f"batch-size ranges and their K, 0 = no drafts; derived from these runs, not itself timed): "
               f"`{json.dumps(schedule)}`." if schedule else "")
            + (" " + pays("Prompt lookup", engine.ngram.pays_up_to_concurrency) if looked else "")
            + (" " + pays("The baseline drafter", engine.baseline.pays_up_to_concurrency) if baseline else "")]


def table(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def by_role(rows: list, role: str) -> list:
    """The rows of one role (the eval's Methods, or the report's MethodRows), in table order."""
    return [r for r in rows if r.role == role]
