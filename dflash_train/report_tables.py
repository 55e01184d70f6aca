"""Markdown tables of an eval report (report.json), one rendering for every reader: the eval's report.md, the model
card, the demo and the serving benchmarks. vLLM's speculation-length sweep (batch 1), its concurrency runs, the
ranking of the speculators, the line on constrained traffic, and the formatting they share (`fmt`, `with_interval`,
`table`). A service: it reads report dicts and imports no stage.
"""

from __future__ import annotations

import json
from typing import Any

from dflash_train.lookup import COMBINED_SETTING, CombinedRule, parse_combined


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


def describe_machine(info: Any, dtype: Any = None) -> str:
    """An eval's `settings.machine` in words: 'AMD EPYC 9R14 (2 cores), bf16, load average 3.1 at the start'."""
    if not isinstance(info, dict):
        return "an unrecorded machine" + (f", {dtype}" if dtype else "")
    words = f"{fmt(info.get('cpu'))} ({fmt(info.get('cores'))} cores)" + (f", GPU {fmt(info['gpu'])}"
                                                                          if info.get("gpu") else "")
    load = info.get("load_average")
    return words + (f", {dtype}" if dtype else "") + (f", load average {fmt(load[0])} at the start"
                                                       if isinstance(load, list) and load else "")


def serving_tables(engine: dict[str, Any], machine: Any) -> list[str]:
    """vLLM's speculation-length table (batch 1) and concurrency table from an eval report's `engines.vllm`: the
    chosen K, how far speculation pays, vLLM's per-batch-size setting, and on what they were measured. One rendering
    for report.md and the model card."""
    sweep = [r for r in engine.get("sweep") or [] if isinstance(r, dict)]
    if not sweep:
        return []
    timing = engine.get("timing") if isinstance(engine.get("timing"), dict) else {}
    lookup = engine.get("ngram") if isinstance(engine.get("ngram"), dict) else None
    suffix = engine.get("suffix") if isinstance(engine.get("suffix"), dict) else None
    looked = sorted((r for r in engine.get("ngram_sweep") or ([lookup] if lookup else []) if isinstance(r, dict)),
                    key=lambda r: r.get("k") or 0)  # every lookup K timed (older reports: the one in ngram)
    lines = ["Speculation length K (`num_speculative_tokens`), one request at a time; τ and speedups with 95% "
             "bootstrap intervals over prompts; tokens/s of whole requests (every new token, prefill included), by "
             "the engine core (from the request's arrival to its last token) and by a stopwatch around each:", "",
             sweep_table(engine, sweep, looked), "", best_k_line(engine, sweep, timing, lookup, looked, suffix)]
    first = timing.get("first_k")
    if isinstance(first, dict):  # under best_k's line, not the ranking's table
        cost = first.get("step_cost")
        lines[-1] += (f" Timed first: K = {fmt(first.get('k'))}, the shortest whose expected "
                      + (f"speed (tau by the {first.get('from')} over a step's cost of {cost[0]:.2f} + {cost[1]:.3f} "
                         f"x K plain decoding steps, as measured on this machine)" if cost else
                         f"tau by the {first.get('from')}")
                      + f" is within {fmt(100 * (first.get('slack') or 0))}% of the best.")
    lines += ranking_lines(engine)
    lines += host_drift_lines(timing, lookup, suffix)
    lines += concurrency_table(engine)
    lines += ["", f"Measured on {describe_machine(machine, engine.get('dtype'))}"
              + (f" ({fmt(timing['load_average_after'][0])} at the end)"
                 if isinstance(timing.get("load_average_after"), list) and timing["load_average_after"] else "")
              + f", vLLM {fmt(engine.get('version'))}: {fmt(timing.get('protocol'))}; "
              f"{fmt(timing.get('repeats'))} timed run(s) per prompt and side. Tokens/s and the best K are a "
              f"measurement of this machine: on another one, measure again (`dflash-train eval`)."]
    return lines


def sweep_table(engine: dict[str, Any], sweep: list[dict[str, Any]], looked: list[dict[str, Any]]) -> str:
    """One row per K timed at batch 1: the drafter's (best_k in bold), then prompt lookup's and suffix decoding's."""
    best_k = engine.get("best_k")
    labelled = [(f"**{r.get('k')}**" if r.get("k") == best_k else fmt(r.get("k")), r)
                for r in sorted(sweep, key=lambda r: r.get("k") or 0)]
    labelled += [(f"{fmt(r.get('k'))}, prompt lookup", r) for r in looked]
    suffixed = sorted((r for r in engine.get("suffix_sweep") or [] if isinstance(r, dict)),
                      key=lambda r: r.get("k") or 0)
    labelled += [(f"{fmt(r.get('k'))}, suffix decoding", r) for r in suffixed]
    if isinstance(combined := engine.get("combined"), dict):
        labelled.append((f"{fmt(combined.get('k'))}, {combined_name(combined)}", combined))
    rows = [(label, with_interval(r.get("tau"), r.get("tau_interval")),
             f"{fmt(r.get('tokens_per_s_baseline'))} / {fmt(r.get('tokens_per_s'))}",
             with_interval(r.get("speedup"), r.get("speedup_interval")) + "×",
             f"{fmt(r.get('tokens_per_s_baseline_wall'))} / {fmt(r.get('tokens_per_s_wall'))}",
             with_interval(r.get("speedup_wall"), r.get("speedup_wall_interval")) + "×",
             f"{fmt(r.get('lossless_mismatches'))} of {fmt(r.get('lossless_checked'))}")
            for label, r in labelled]
    return table(rows, ("K", "τ", "Tokens/s plain / speculative", "Speedup", "Stopwatch: tokens/s plain / "
                        "speculative", "Stopwatch: speedup", "Lossless mismatches"))


def best_k_line(engine: dict[str, Any], sweep: list[dict[str, Any]], timing: dict[str, Any],
                lookup: dict[str, Any] | None, looked: list[dict[str, Any]], suffix: dict[str, Any] | None) -> str:
    """The line under the K table: best_k, how often the resampled prompts pick it, the K the time budget left out;
    prompt lookup and suffix decoding against the drafter, and how to serve the one of them that is faster."""
    best_k, share, skipped = engine.get("best_k"), engine.get("best_k_share"), timing.get("skipped_k") or []
    line = (f"best_k = {fmt(best_k)}: the fastest at batch 1"
            + (f" (in {share:.0%} of the bootstrap resamples of the prompts)" if isinstance(share, float) else "")
            + (f"; not measured within the time budget ({fmt(timing.get('budget_s'))} s): K = {fmt(skipped)}"
               if skipped else "") + ".")
    if lookup:
        mine = next((r for r in sweep if r.get("k") == best_k), {})
        config = lookup.get("engine_args") if isinstance(lookup.get("engine_args"), dict) else {}
        line += (f" Prompt lookup: vLLM's own `ngram` speculator, no model (the tokens that followed an earlier "
                 f"occurrence of the context's last n tokens, n from {fmt(config.get('prompt_lookup_max'))} "
                 f"down to {fmt(config.get('prompt_lookup_min'))}), timed the same way on the same prompts: "
                 f"the baseline a drafter has to beat: {fmt(lookup.get('speedup'))}× at K = "
                 f"{fmt(lookup.get('k'))}"
                 + (f" (the fastest of K = {', '.join(fmt(r.get('k')) for r in looked)})" if len(looked) > 1
                    else "") + f" against the drafter's {fmt(mine.get('speedup'))}× at best_k.")
    if suffix:
        line += (f" Suffix decoding: vLLM's `suffix` speculator, no model (drafts from a suffix tree over the "
                 f"prompt and the answers the engine gave before), timed the same way: "
                 f"{fmt(suffix.get('speedup'))}× at K = {fmt(suffix.get('k'))}.")
    if isinstance(combined := engine.get("combined"), dict):
        line += " " + combined_line(combined)
    if (served := speculator_to_serve(engine)) is not None:  # what to serve: the fastest of them
        line += f" {served['name'][0].upper()}{served['name'][1:]} is the fastest here: " + (
            f"serve it with `--speculative-config '{json.dumps(served['config'], separators=(',', ':'))}'` in "
            f"place of the drafter's." if not served.get("environment") else
            f"serve the drafter as below with `{served['environment']}` set and dflash-train installed beside vLLM "
            f"(its plugin).")
    return line


def combined_name(combined: dict[str, Any]) -> str:
    """The combined speculator's sources, from its entry's setting ("drafter + prompt lookup" where unreadable)."""
    try:
        return parse_combined(str(combined.get("setting") or "")).name
    except ValueError:
        return CombinedRule().name


def combined_line(combined: dict[str, Any]) -> str:
    """What the combined speculator did: its speedup and tau at its K, and its blocks by source."""
    sources = combined.get("sources") if isinstance(combined.get("sources"), dict) else {}
    blocks = {s: c.get("blocks") or 0 for s, c in sources.items() if isinstance(c, dict)}
    kept = ", ".join(f"{fmt(c.get('accepted'))} of {fmt(c.get('drafted'))} drafts kept from {s}"
                     for s, c in sources.items() if isinstance(c, dict))
    total = sum(blocks.values())
    unasked = sum(c.get("without_drafter") or 0 for c in sources.values() if isinstance(c, dict))
    free = [s for s in ("suffix", "lookup") if blocks.get(s)]
    with_suffix = "suffix" in combined_name(combined)
    return (f"The combined speculator (this package's vLLM plugin: the drafter, "
            + ("the suffix tree's block (over the prompt and the answers this engine gave before) where its own "
               "score reaches the rule's `suffix`, else " if with_suffix else "and ")
            + "prompt lookup's block where lookup matched and the drafter's first draft is less likely than the "
              "rule says (at confidence 1: wherever lookup matched); a step whose blocks need no drafter skips its "
              f"pass; `{combined.get('setting')}`), timed the same way at K = {fmt(combined.get('k'))}: "
            f"{fmt(combined.get('speedup'))}×, τ {fmt(combined.get('tau'))}"
            + (f"; of {fmt(total)} blocks " + ", ".join(f"{fmt(blocks[s])} came from {s}" for s in free)
               + (f", {fmt(unasked)} at steps that skipped the drafter's pass" if unasked else "")
               + f" ({kept})" if total and free else "")
            + "".join(f"; against {'the ' * (name == 'drafter')}{name} at K = {fmt(vs.get('k'))}, paired by "
                      f"prompt: τ "
                      f"{with_interval(vs.get('tau_ratio'), vs.get('tau_ratio_interval'))}×, speedup "
                      f"{with_interval(vs.get('speedup_ratio'), vs.get('speedup_ratio_interval'))}×"
                      for name, vs in (combined.get("against") or {}).items() if isinstance(vs, dict))
            + ".")


def host_drift_lines(timing: dict[str, Any], lookup: dict[str, Any] | None, suffix: dict[str, Any] | None
                     ) -> list[str]:
    """The warning where plain decoding's own speed moved while the sweep measured (the entry's
    timing.host_unsteady); [] on a steady machine."""
    plain = timing.get("plain_tokens_per_s_decode")
    if not (timing.get("host_unsteady") is True and isinstance(plain, dict)):
        return []
    rates = [v for v in plain.values() if isinstance(v, (int, float))]
    runs = "the K's runs" + (" and prompt lookup's" if lookup else "") + (" and suffix decoding's" if suffix else "")
    return ["", f"**The machine's speed changed while it was measured**: plain decoding ran at "
                f"{min(rates):.1f} to {max(rates):.1f} tokens/s (decode phase) over the reference pass and "
                f"{runs}, {timing.get('host_drift'):.0%} apart, on the same prompts at the same lengths. "
                f"A speedup here can be off by about as much, and K measured at different times are not "
                f"comparable: measure again on a quiet machine (`--repeats 2` pairs each prompt twice)."]


def constraints_markdown(c: dict[str, Any] | None) -> list[str]:
    """The report's and the card's line on constrained traffic: what share of the prompts was decoded under
    their requests' own constraints, of which kinds, and what was left out."""
    if not isinstance(c, dict) or not isinstance(c.get("constrained"), int) or not c["constrained"]:
        return []
    by_kind = c.get("by_kind") if isinstance(c.get("by_kind"), dict) else {}
    without = c.get("decoded_without") if isinstance(c.get("decoded_without"), dict) else {}
    kinds = ", ".join(f"{fmt(n)} {kind}" for kind, n in by_kind.items() if kind != "none")
    left = [f"{fmt(n)} without their {key}" for key, n in without.items() if n]
    share = (f" ({100 * c['constrained'] / c['of']:.0f}%)" if isinstance(c.get("of"), int) and c["of"] > 0 else "")
    return [f"Constrained traffic: {c['constrained']} of {fmt(c.get('of'))} prompts{share} decoded under their "
            f"requests' own constraints ({kinds}; 'settings': stop strings, penalties and the like), plain and "
            f"speculative alike" + (f"; {', '.join(left)} (vLLM refuses them with speculative decoding)" if left
                                    else "") + ".", ""]


# The speculators an eval times beside the drafter: their keys in the engine entry and their names in prose
BESIDE_THE_DRAFTER = (("ngram", "prompt lookup"), ("suffix", "suffix decoding"),
                      ("combined", "the combined speculator"))


def speculator_to_serve(engine: dict[str, Any]) -> dict[str, Any] | None:
    """The speculator to serve instead of the drafter alone, or None: vLLM's prompt lookup (the entry's `ngram`),
    suffix decoding (`suffix`), each at its fastest K, or the combined speculator (`combined`, at its K),
    where the fastest of them beat the drafter at best_k one request at a time (the entry's headline speedup).
    {name, k, speedup, config}; the combined one also names the `environment` setting that turns it on."""
    best = None
    for key, name in BESIDE_THE_DRAFTER:
        entry = engine.get(key) if isinstance(engine.get(key), dict) else {}
        if entry and (entry.get("speedup") or 0) > max(engine.get("speedup") or 0, best["speedup"] if best else 0):
            config = entry.get("engine_args") if isinstance(entry.get("engine_args"), dict) else {}
            best = {"name": name, "k": entry.get("k"), "speedup": entry.get("speedup") or 0, "config": config}
            if key == "combined":
                best["environment"] = f"{COMBINED_SETTING}={entry.get('setting')}"
    return best


def ranking_lines(engine: dict[str, Any]) -> list[str]:
    """The drafter, prompt lookup, suffix decoding and the combined speculator ranked at their own fastest K (the
    entry's `ranking`), when more than one of them ran."""
    ranked = [r for r in engine.get("ranking") or [] if isinstance(r, dict)]
    if len(ranked) < 2:
        return []
    rows = [(str(i), r.get("speculator"), fmt(r.get("k")), with_interval(r.get("tau"), r.get("tau_interval")),
             with_interval(r.get("speedup"), r.get("speedup_interval")) + "×", fmt(r.get("lossless_mismatches")))
            for i, r in enumerate(ranked, 1)]
    prompts = {r.get("prompts") for r in ranked}
    on = f"the same {prompts.pop()} prompts" if len(prompts) == 1 and None not in prompts else "the same prompts"
    return ["", f"Ranked by speed one request at a time, each at its own fastest K, on {on}:", "",
            table(rows, ("Rank", "Speculator", "K", "τ", "Speedup", "Lossless mismatches"))]


def concurrency_table(engine: dict[str, Any]) -> list[str]:
    """The eval's runs of several requests decoded together (`engines.vllm`), the drafter's K and prompt lookup's
    (its `ngram` entry) side by side at each concurrency, and how far each pays; [] where none ran."""
    concurrency = [r for r in engine.get("concurrency") or [] if isinstance(r, dict)]
    if not any(r.get("requests") != 1 for r in concurrency):
        return []
    lookup = engine.get("ngram") if isinstance(engine.get("ngram"), dict) else {}
    looked = [r for r in lookup.get("concurrency") or [] if isinstance(r, dict)]
    best = {(r.get("requests"), r.get("k")) for r in engine.get("concurrency_best") or [] if isinstance(r, dict)}
    labelled = [(f"**{r.get('k')}**" if (r.get("requests"), r.get("k")) in best else fmt(r.get("k")), r)
                for r in concurrency] + [(f"{fmt(r.get('k'))}, prompt lookup", r) for r in looked]
    rows = [(fmt(r.get("requests")), label, f"{fmt(r.get('tokens_per_s_baseline'))} / {fmt(r.get('tokens_per_s'))}",
             f"{fmt(r.get('speedup'))}×", f"{fmt(r.get('tokens_per_s_baseline_wall'))} / "
             f"{fmt(r.get('tokens_per_s_wall'))}", f"{fmt(r.get('speedup_wall'))}×")
            for label, r in sorted(labelled, key=lambda lr: lr[1].get("requests") or 0)]  # stable: lookup last
    schedule = engine.get("per_batch_size_schedule")

    def pays(who: str, paid: Any) -> str:
        return (f"{who} does not pay here, even one request at a time." if not paid else
                f"{who} pays one request at a time only." if paid == 1 else
                f"{who} pays up to {fmt(paid)} requests decoded together (of those measured).")
    return ["", "Requests decoded together (the drafter's fastest K at each in bold; tokens/s of all requests):", "",
            table(rows, ("Requests", "K", "Tokens/s plain / speculative", "Speedup",
                         "Stopwatch: tokens/s plain / speculative", "Stopwatch: speedup")), "",
            pays("Speculation", engine.get("pays_up_to_concurrency"))
            + (f" The fastest K per batch size as vLLM's `num_speculative_tokens_per_batch_size` (inclusive "
               f"batch-size ranges and their K, 0 = no drafts; derived from these runs, not itself timed): "
               f"`{json.dumps(schedule)}`." if schedule else "")
            + (" " + pays("Prompt lookup", lookup.get("pays_up_to_concurrency")) if looked else "")]


def table(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def by_role(rows: list, role: str) -> list:
    """The rows of one role (the eval's Methods, or report["methods"] dicts), in table order."""
    return [r for r in rows if (r.get("role") if isinstance(r, dict) else r.role) == role]
