"""The eval's report: report.json (strict JSON), report.md (the tables, dflash_train.report_tables for vLLM's) and the
plots (acceptance by block position, the tau histogram)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash_train.provenance import write_json_atomic
from dflash_train.report_tables import by_role, constraints_markdown, serving_tables, with_interval
from dflash_train.stages.evaluate.own_loop import drafter_label


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    skipped = f" ({s['skipped_long_prompts']} longer than {s['max_prompt_tokens']} tokens skipped)" \
        if s.get("skipped_long_prompts") else ""
    lines = [f"# Eval: drafter {drafter_label(s['drafter'])} on target {report['target']['name']}", "",
             f"{s['num_prompts']} prompts from `{s['prompts']}` (split {s['split']}){skipped}, up to "
             f"{s['max_new_tokens']} new tokens, {s['sampling']}, {s['dtype']} on {s['device']} "
             f"({s['threads']} threads), block size {report['block_size']}."
             + (f" The project's loop decoded the first {s['own_prompts']} of them (--own-limit)."
                if s.get("own_prompts", s["num_prompts"]) < s["num_prompts"] else ""), ""]
    lines += constraints_markdown(s.get("constraints"))
    lines += _engines_markdown(report)
    if report["methods"]:
        lines += _own_loop_markdown(report)
    if report["offline"]:
        o = report["offline"]
        lines += [f"Offline estimate (`{o['store']}`, {o['num_samples']} samples, {o['samples_of_eval_prompts']} "
                  f"of them of the prompts above; {o['num_anchors']} anchors, no target forward): tau "
                  f"{_fmt(o['tau'])} as greedy decoding walks the answers (the mean over every anchor: "
                  f"{_fmt(o['tau_every_anchor'])}); online - offline = "
                  f"{_fmt(report['tau_gap'])}.", ""]
    lines += _acceptance_markdown(report)
    lines += ["", "tau = 1 + accepted drafts (at most B), per verification step; "
              "tokens/s of the decode phase count the tokens after the first (prefill excluded), of a whole "
              "request every new token; speedup = tokens/s over plain decoding's on the same prompts in the same "
              "run.", ""]
    return "\n".join(lines)


# (label, the project's loop's key, vLLM's key, digits): the same quantity in both columns, or "-" where one has none
ENGINE_ROWS = (("tau (mean over prompts) [95% interval]", "tau", "tau", 2),
               ("tau (all steps)", "tau_steps", "tau_steps", 2), ("verification steps", "num_steps", "num_steps", 0),
               ("tokens/s plain / speculative, decode phase", "tokens_per_s", "tokens_per_s_decode", 1),
               ("speedup, decode phase [95%]", "speedup", "speedup_decode", 2),
               ("tokens/s plain / speculative, whole request (engine)", None, "tokens_per_s", 1),
               ("speedup, whole request (engine) [95%]", None, "speedup", 2),
               ("tokens/s plain / speculative, whole request (stopwatch)", None, "tokens_per_s_wall", 1),
               ("speedup, whole request (stopwatch) [95%]", None, "speedup_wall", 2),
               ("lossless mismatches", "lossless_mismatches", "lossless_mismatches", 0))


def _engines_markdown(report: dict[str, Any]) -> list[str]:
    """The engine and the project's loop side by side, and what each counts; vLLM's K sweep and concurrency."""
    engines = report.get("engines") or {}
    if not engines.get("vllm"):
        return []
    names = {"own": "project's loop (transformers)", "vllm": f"vLLM {engines['vllm'].get('version')}"
             + (f", K = {engines['vllm']['best_k']}" if engines["vllm"].get("best_k") else "")}
    cols = [k for k in ("own", "vllm") if engines.get(k)]
    lines = ["## The drafter in the engine and in the project's loop", "",
             "| | " + " | ".join(names[c] for c in cols) + " |", "|---" * (1 + len(cols)) + "|"]
    for label, own_key, vllm_key, digits in ENGINE_ROWS:
        cells = []
        for c in cols:
            key = own_key if c == "own" else vllm_key
            value = engines[c].get(key) if key else None
            if value is None:
                cells.append("-")
            elif key.startswith("lossless"):
                cells.append(f"{value} of {engines[c].get('lossless_checked')}")
            elif key.startswith("tokens_per_s"):
                baseline = engines[c].get(key.replace("tokens_per_s", "tokens_per_s_baseline", 1))
                cells.append(f"{_fmt(baseline, digits)} / {_fmt(value, digits)}")
            elif f"{key}_interval" in engines[c] or key == "tau":
                cells.append(with_interval(value, engines[c].get(f"{key}_interval")))
            else:
                cells.append(_fmt(float(value) if isinstance(value, int) and digits else value, digits))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for k in range(1, min(4, report["block_size"])):
        cells = [_fmt(_at(engines[c].get("per_position_acceptance") or [], k - 1), 3) for c in cols]
        lines.append(f"| acceptance at position {k} | " + " | ".join(cells) + " |")
    v = engines["vllm"]
    lines += ["", "Both decode the same token ids (the project renders the chat template once), greedy, batch 1. "
              "The project's loop: transformers target + the drafter module, tau from its own verification steps, "
              "tokens/s from its own clock around the decode phase. vLLM: its own DFlash implementation loading the "
              "drafter folder as shipped, tau from its per-request speculative-decoding metrics (accepted drafts per "
              "verification step) with the same definition; tokens/s from the engine core's timestamps (the whole "
              "request from its arrival, or the decode phase from its first token) and by a stopwatch around each "
              "whole request.", ""]
    tables = serving_tables(v, report["settings"].get("machine"))
    lines += tables + [""] if tables else []
    lines += [f"vLLM command: `{v.get('serve_command')}`", ""]
    if v.get("refused_by_engine"):
        lines += [f"vLLM refused {len(v['refused_by_engine'])} prompt(s), left out of every run and comparison:"]
        lines += [f"- {rid}: {why}" for rid, why in v["refused_by_engine"].items()] + [""]
    if v.get("lossless_note"):
        lines += [f"vLLM lossless check {v['lossless_note']}.", ""]
    for d in v.get("mismatches") or []:
        line = (f"- vLLM, {d['id']}: first difference at new token {d['index']}: plain {d['plain_token']}, "
                f"speculative {d['spec_token']}, top-2 logit margin {_fmt(d.get('top2_margin'), 4)}")
        if "fp32_spec_equals_plain" in d:
            line += f"; rerun in fp32: speculative {'equals' if d['fp32_spec_equals_plain'] else 'differs from'} plain"
        lines.append(line)
    if v.get("tokens_unaccounted_by_steps"):
        lines.append(f"Warning: {v['tokens_unaccounted_by_steps']} output tokens are not accounted for by vLLM's "
                     f"verification steps (decode steps without drafts).")
    return lines + [""]


def _own_loop_markdown(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    lines = ["## The project's decoding loop", "",
             "| method | block | tau (mean over prompts) | tau (all steps) | tokens/target forward | tokens/s | "
             "speedup | drafting share of decode time | lossless mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["methods"]:
        lines.append(f"| {row['method']} | {row['block_size']} | {_fmt(row.get('tau'))} | "
                     f"{_fmt(row.get('tau_steps'))} | {_fmt(row['tokens_per_target_forward'])} | "
                     f"{_fmt(row['tokens_per_s'], 1)} | {_fmt(row['speedup'])}x | "
                     f"{_fmt(row['draft_s'] / row['decode_s'] if row['decode_s'] and row['draft_s'] else None)} | "
                     f"{row.get('lossless_mismatches', '-')} |")
    lines.append("")
    if refused := (report.get("engines") or {}).get("own", {}).get("refused_by_engine"):
        lines += [f"Not decoded here: the {len(refused)} prompt(s) vLLM refused ({', '.join(refused)}; its reasons "
                  f"above), left out of every comparison.", ""]
    mismatches = report["lossless_mismatches"]
    lines.append(f"Lossless check: {mismatches} of {report['lossless_checked']} prompts differ from plain decoding "
                 f"for the drafter.")
    for d in report["mismatches"]:
        line = (f"- {d['id']} ({d['method']}): first difference at new token {d['index']}: plain "
                f"{d['plain_token']}, speculative {d['spec_token']}, top-2 logit margin "
                f"{_fmt(d.get('top2_margin'), 4)}")
        if "fp32_spec_equals_plain" in d:
            same = {True: "equals", False: "differs from"}
            line += (f"; rerun in fp32: speculative {same[d['fp32_spec_equals_plain']]} plain; {s['dtype']} plain "
                     f"decoding {same[d['plain_equals_fp32_plain']]} fp32 plain decoding")
        lines.append(line)
    if report.get("lossless_mismatches_fp32") == 0:
        lines.append(f"Rerun in fp32, all of these prompts match: the {s['dtype']} differences are near-ties that "
                     f"the block verification and the one-token decode round differently, not a decoding error.")
    elif report.get("lossless_mismatches_fp32"):
        lines.append(f"Rerun in fp32, {report['lossless_mismatches_fp32']} of these prompts still differ: "
                     f"a decoding error, not rounding.")
    return lines + [""]


def _acceptance_markdown(report: dict[str, Any]) -> list[str]:
    """Acceptance by block position: every drafter of the project's loop, vLLM, and the offline estimate."""
    columns = [(r["method"], r["per_position_acceptance"]) for r in report["methods"] if r["block_size"] > 1]
    if (report.get("engines") or {}).get("vllm"):
        drafter = by_role(report["methods"], "drafter")
        columns.append((f"vLLM: {drafter[0]['method'] if drafter else 'drafter'}",
                        report["engines"]["vllm"]["per_position_acceptance"]))
    if report["offline"]:
        columns.append(("offline", report["offline"]["per_position_acceptance"]))
    lines = ["Acceptance by block position (share of steps accepting at least k drafts):", "",
             "| k | " + " | ".join(name for name, _ in columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for k in range(1, report["block_size"]):
        lines.append(f"| {k} | " + " | ".join(_fmt(_at(values or [], k - 1), 3) for _, values in columns) + " |")
    return lines


def _at(values: list[float], i: int) -> float | None:
    return values[i] if i < len(values) else None


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["methods"] if r.get("tau") is not None and r["block_size"] > 1]
    engine = (report.get("engines") or {}).get("vllm")
    if engine and engine.get("tau") is not None:
        rows.append({"method": f"vLLM {engine['version']}" + (f", K = {engine['best_k']}" if engine.get("best_k")
                                                               else ""), "tau": engine["tau"],
                     "block_size": len(engine["per_position_acceptance"]) + 1,
                     "per_position_acceptance": engine["per_position_acceptance"],
                     "tau_histogram": engine["tau_histogram"]})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        ks = list(range(1, r["block_size"]))
        ax.plot(ks, r["per_position_acceptance"], marker="o", label=f"{r['method']} (tau {_fmt(r['tau'])})")
    if report["offline"]:
        o = report["offline"]
        ax.plot(range(1, report["block_size"]), o["per_position_acceptance"], linestyle="--", marker="x",
                label=f"offline estimate (tau {_fmt(o['tau'])})")
    ax.set(xlabel="block position k", ylabel="share of steps accepting >= k drafts", ylim=(0, 1.02),
           title="Acceptance by block position")
    ax.set_xticks(range(1, report["block_size"]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    position_png = out / "acceptance_by_position.png"
    fig.savefig(position_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    B = report["block_size"]
    width = 0.8 / max(1, len(rows) + bool(report["offline"]))
    series = [(r["method"], r["tau_histogram"]) for r in rows]
    if report["offline"]:
        series.append(("offline estimate", report["offline"]["tau_histogram"]))
    for i, (name, hist) in enumerate(series):
        total = sum(hist.values()) or 1
        xs = [v + (i - (len(series) - 1) / 2) * width for v in range(1, B + 1)]
        ax.bar(xs, [hist.get(str(v), 0) / total for v in range(1, B + 1)], width=width, label=name)
    ax.set(xlabel="tau (acceptance length of a verification step)", ylabel="share of steps", title="tau histogram")
    ax.set_xticks(range(1, B + 1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    hist_png = out / "tau_histogram.png"
    fig.savefig(hist_png, dpi=120)
    plt.close(fig)
    return [position_png, hist_png]


def _finite(x: Any) -> Any:
    """NaN (a metric over nothing, e.g. no steps) -> None: report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_report(report: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "report.json", _finite(report))
    (out / "report.md").write_text(markdown(report))
    plot(report, out)
