"""The eval's report: report.json (dflash_train.eval_report, strict JSON), report.md (the tables,
dflash_train.report_tables for vLLM's) and the plots (acceptance by block position, the tau histogram)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from dflash_train.eval_report import Acceptance, EvalReport, OwnLoop, VllmEval, dump
from dflash_train.report_tables import by_role, constraints_markdown, serving_tables, with_interval
from dflash_train.stages.evaluate.own_loop import drafter_label


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(report: EvalReport) -> str:
    s, o = report.settings, report.settings.options
    skipped = f" ({s.skipped_long_prompts} longer than {o.get('max_prompt_tokens')} tokens skipped)" \
        if s.skipped_long_prompts else ""
    lines = [f"# Eval: drafter {drafter_label(report.drafter.path)} on target "
             f"{report.target.name if report.target else '-'}", "",
             f"{s.num_prompts} prompts from `{o.get('prompts')}` (split {o.get('split')}){skipped}, up to "
             f"{o.get('max_new_tokens')} new tokens, {s.sampling}, {s.dtype} on {s.device} "
             f"({s.threads} threads), block size {report.block_size}."
             + (f" The project's loop decoded the first {s.own_prompts} of them (--own-limit)."
                if s.own_prompts is not None and s.own_prompts < s.num_prompts else ""), ""]
    lines += constraints_markdown(s.constraints)
    lines += _engines_markdown(report)
    if report.own:
        lines += _own_loop_markdown(report.own, s.dtype, report.vllm.refused_by_engine if report.vllm else {})
    if o := report.offline:
        lines += [f"Offline estimate (`{o.store}`, {o.num_samples} samples, {o.samples_of_eval_prompts} "
                  f"of them of the prompts above; {o.num_anchors} anchors, no target forward): tau "
                  f"{_fmt(o.tau_steps)} as greedy decoding walks the answers (the mean over samples: "
                  f"{_fmt(o.tau_per_prompt)}; over every anchor: {_fmt(o.tau_every_anchor)}); online - offline = "
                  f"{_fmt(report.tau_gap)}.", ""]
    lines += _acceptance_markdown(report)
    lines += ["", "tau = 1 + accepted drafts (at most B) per verification step, over all steps (the tokens committed "
              "per target forward); its mean over prompts of each prompt's own mean is the distribution figure beside "
              "it; tokens/s of the decode phase count the tokens after the first (prefill excluded), of a whole "
              "request every new token; speedup = tokens/s over plain decoding's on the same prompts in the same "
              "run.", ""]
    return "\n".join(lines)


def _pair(base: float | None, value: float | None) -> str:
    return f"{_fmt(base, 1)} / {_fmt(value, 1)}"


# (label, the project's loop's cell, vLLM's cell): the same quantity in both columns, or "-" where one has none
ENGINE_ROWS: tuple[tuple[str, Callable[[OwnLoop], str] | None, Callable[[VllmEval], str]], ...] = (
    ("tau (all steps) [95% interval]", lambda e: with_interval(e.tau_steps, e.tau_steps_interval),
     lambda e: with_interval(e.tau_steps, e.tau_steps_interval)),
    ("tau (mean over prompts) [95%]", lambda e: with_interval(e.tau_per_prompt, e.tau_per_prompt_interval),
     lambda e: with_interval(e.tau_per_prompt, e.tau_per_prompt_interval)),
    ("verification steps", lambda e: _fmt(e.num_steps), lambda e: _fmt(e.num_steps)),
    ("tokens/s plain / speculative, decode phase", lambda e: _pair(e.tokens_per_s_baseline, e.tokens_per_s),
     lambda e: _pair(e.tokens_per_s_baseline_decode, e.tokens_per_s_decode)),
    ("speedup, decode phase [95%]", lambda e: with_interval(e.speedup, e.speedup_interval),
     lambda e: with_interval(e.speedup_decode, e.speedup_decode_interval)),
    ("tokens/s plain / speculative, whole request (engine)", None,
     lambda e: _pair(e.tokens_per_s_baseline, e.tokens_per_s)),
    ("speedup, whole request (engine) [95%]", None, lambda e: with_interval(e.speedup, e.speedup_interval)),
    ("tokens/s plain / speculative, whole request (stopwatch)", None,
     lambda e: _pair(e.tokens_per_s_baseline_wall, e.tokens_per_s_wall)),
    ("speedup, whole request (stopwatch) [95%]", None,
     lambda e: with_interval(e.speedup_wall, e.speedup_wall_interval)),
    ("lossless mismatches", lambda e: f"{_fmt(e.lossless_mismatches)} of {e.lossless_checked}",
     lambda e: f"{_fmt(e.lossless_mismatches)} of {e.lossless_checked}"))


def _engines_markdown(report: EvalReport) -> list[str]:
    """The engine and the project's loop side by side, and what each counts; vLLM's K sweep and concurrency."""
    v = report.vllm
    if not v:
        return []
    names = ["project's loop (transformers)"] * bool(report.own) + [
        f"vLLM {v.version}" + (f", K = {v.best_k}" if v.best_k else "")]
    lines = ["## The drafter in the engine and in the project's loop", "",
             "| | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    for label, own_cell, vllm_cell in ENGINE_ROWS:
        cells = ([own_cell(report.own) if own_cell else "-"] if report.own else []) + [vllm_cell(v)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    engines = ([report.own] if report.own else []) + [v]
    for k in range(1, min(4, report.block_size)):
        cells = [_fmt(_at(e.per_position_acceptance, k - 1), 3) for e in engines]
        lines.append(f"| acceptance at position {k} | " + " | ".join(cells) + " |")
    lines += ["", "Both decode the same token ids (the project renders the chat template once), greedy, batch 1. "
              "The project's loop: transformers target + the drafter module, tau from its own verification steps, "
              "tokens/s from its own clock around the decode phase. vLLM: its own DFlash implementation loading the "
              "drafter folder as shipped, tau from its per-request speculative-decoding metrics (accepted drafts per "
              "verification step) with the same definition; tokens/s from the engine core's timestamps (the whole "
              "request from its arrival, or the decode phase from its first token) and by a stopwatch around each "
              "whole request.", ""]
    tables = serving_tables(v, report.settings.machine)
    lines += tables + [""] if tables else []
    lines += [f"vLLM command: `{v.serve_command}`", ""]
    if v.refused_by_engine:
        lines += [f"vLLM refused {len(v.refused_by_engine)} prompt(s), left out of every run and comparison:"]
        lines += [f"- {rid}: {why}" for rid, why in v.refused_by_engine.items()] + [""]
    if v.lossless_note:
        lines += [f"vLLM lossless check {v.lossless_note}.", ""]
    for d in v.mismatches:
        line = (f"- vLLM, {d.id}: first difference at new token {d.index}: plain {d.plain_token}, "
                f"speculative {d.spec_token}, top-2 logit margin {_fmt(d.top2_margin, 4)}")
        if d.fp32_spec_equals_plain is not None:
            line += f"; rerun in fp32: speculative {'equals' if d.fp32_spec_equals_plain else 'differs from'} plain"
        lines.append(line)
    if v.tokens_unaccounted_by_steps:
        lines.append(f"Warning: {v.tokens_unaccounted_by_steps} output tokens are not accounted for by vLLM's "
                     f"verification steps (decode steps without drafts).")
    return lines + [""]


def _own_loop_markdown(own: OwnLoop, dtype: str | None, refused: dict[str, str]) -> list[str]:
    """The project's loop's section; `refused`: the prompts vLLM refused, which it did not decode."""
    lines = ["## The project's decoding loop", "",
             "| method | block | tau (all steps) | tau (mean over prompts) | tokens/target forward | tokens/s | "
             "speedup | drafting share of decode time | lossless mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in own.methods:
        lines.append(f"| {row.method} | {row.block_size} | {_fmt(row.tau_steps)} | {_fmt(row.tau_per_prompt)} | "
                     f"{_fmt(row.tokens_per_target_forward)} | {_fmt(row.tokens_per_s, 1)} | {_fmt(row.speedup)}x | "
                     f"{_fmt(row.draft_s / row.decode_s if row.decode_s and row.draft_s else None)} | "
                     f"{_fmt(row.lossless_mismatches)} |")
    lines.append("")
    if refused:
        lines += [f"Not decoded here: the {len(refused)} prompt(s) vLLM refused ({', '.join(refused)}; its reasons "
                  f"above), left out of every comparison.", ""]
    lines.append(f"Lossless check: {own.lossless_mismatches} of {own.lossless_checked} prompts differ from plain "
                 f"decoding for the drafter.")
    for d in own.mismatches:
        line = (f"- {d.id} ({d.method}): first difference at new token {d.index}: plain {d.plain_token}, "
                f"speculative {d.spec_token}, top-2 logit margin {_fmt(d.top2_margin, 4)}")
        if d.fp32_spec_equals_plain is not None:
            same = {True: "equals", False: "differs from", None: "-"}
            line += (f"; rerun in fp32: speculative {same[d.fp32_spec_equals_plain]} plain; {dtype} plain "
                     f"decoding {same[d.plain_equals_fp32_plain]} fp32 plain decoding")
        lines.append(line)
    if own.lossless_mismatches_fp32 == 0:
        lines.append(f"Rerun in fp32, all of these prompts match: the {dtype} differences are near-ties that "
                     f"the block verification and the one-token decode round differently, not a decoding error.")
    elif own.lossless_mismatches_fp32:
        lines.append(f"Rerun in fp32, {own.lossless_mismatches_fp32} of these prompts still differ: "
                     f"a decoding error, not rounding.")
    return lines + [""]


def _acceptance_markdown(report: EvalReport) -> list[str]:
    """Acceptance by block position: every drafter of the project's loop, vLLM, and the offline estimate."""
    methods = report.own.methods if report.own else []
    columns = [(r.method, r.per_position_acceptance) for r in methods if r.block_size > 1]
    if report.vllm:
        drafter = by_role(methods, "drafter")
        columns.append((f"vLLM: {drafter[0].method if drafter else 'drafter'}", report.vllm.per_position_acceptance))
    if report.offline:
        columns.append(("offline", report.offline.per_position_acceptance))
    lines = ["Acceptance by block position (share of steps accepting at least k drafts):", "",
             "| k | " + " | ".join(name for name, _ in columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for k in range(1, report.block_size):
        lines.append(f"| {k} | " + " | ".join(_fmt(_at(values, k - 1), 3) for _, values in columns) + " |")
    return lines


def _at(values: list[float | None], i: int) -> float | None:
    return values[i] if i < len(values) else None


def plot(report: EvalReport, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    B = report.block_size
    # (name, block size, its figures): the project's loop's drafters, vLLM at best_k, the offline estimate
    series: list[tuple[str, int, Acceptance]] = [(r.method, r.block_size, r) for r in
                                                (report.own.methods if report.own else [])
                                                if r.tau_steps is not None and r.block_size > 1]
    if (v := report.vllm) and v.tau_steps is not None:
        series.append((f"vLLM {v.version}" + (f", K = {v.best_k}" if v.best_k else ""),
                       len(v.per_position_acceptance) + 1, v))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, block, r in series:
        ax.plot(range(1, block), r.per_position_acceptance, marker="o", label=f"{name} (tau {_fmt(r.tau_steps)})")
    if o := report.offline:
        ax.plot(range(1, B), o.per_position_acceptance, linestyle="--", marker="x",
                label=f"offline estimate (tau {_fmt(o.tau_steps)})")
    ax.set(xlabel="block position k", ylabel="share of steps accepting >= k drafts", ylim=(0, 1.02),
           title="Acceptance by block position")
    ax.set_xticks(range(1, B))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    position_png = out / "acceptance_by_position.png"
    fig.savefig(position_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if report.offline:
        series.append(("offline estimate", B, report.offline))
    width = 0.8 / max(1, len(series))
    for i, (name, _, r) in enumerate(series):
        total = sum(r.tau_histogram.values()) or 1
        xs = [v + (i - (len(series) - 1) / 2) * width for v in range(1, B + 1)]
        ax.bar(xs, [r.tau_histogram.get(str(v), 0) / total for v in range(1, B + 1)], width=width, label=name)
    ax.set(xlabel="tau (acceptance length of a verification step)", ylabel="share of steps", title="tau histogram")
    ax.set_xticks(range(1, B + 1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    hist_png = out / "tau_histogram.png"
    fig.savefig(hist_png, dpi=120)
    plt.close(fig)
    return [position_png, hist_png]


def write_report(report: EvalReport, out: Path) -> None:
    dump(report, out / "report.json")
    (out / "report.md").write_text(markdown(report))
    plot(report, out)
