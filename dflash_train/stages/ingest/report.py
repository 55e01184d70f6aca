"""Ingest's report: what happened to every record of every log (report.json), and its printed summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

from dflash_train.logs.values import BAD_REASONS, SKIP_REASONS, SKIPPED_FILE, SourceStats
from dflash_train.pii import KINDS as PII_KINDS
from dflash_train.prompts import SEEN_IDS_FILE, IngestReport
from dflash_train.stages.ingest.config import IngestConfig


def source_totals(sources: list[SourceStats]) -> Counter:
    total: Counter = Counter()
    for s in sources:
        total.update(s.counts)
    return total


def format_counts(counts: Counter | dict, keys: Iterable[str] = SKIP_REASONS) -> str:
    return ", ".join(f"{k} {counts.get(k, 0)}" for k in keys)


def build_report(sources: list[SourceStats], paths: list[Path], config: IngestConfig, splits: dict,
                 fallback_id: str | None, stopped_at_max: bool, weight_stats: tuple[int, int], seen_prompts: int,
                 wall_s: float) -> IngestReport:
    """report.json: the counts of every source and their totals, what was kept and split, and the config.
    `seen_prompts`: how many of the --exclude-ids prompts the logs held (their records: `seen`)."""
    totals = source_totals(sources)
    pii: Counter = Counter()
    formats: Counter = Counter()
    for s in sources:
        pii.update(s.pii)
        formats.update(s.formats)
    report: IngestReport = {key: totals[key] for key in ("read", "kept", "duplicates", "seen") + SKIP_REASONS}
    report.update({
        "blank_lines": totals["blank_lines"],
        "with_tools": totals["with_tools"],  # records with tool calls, tool results or tool definitions
        "constrained": totals["constrained"],  # records with constraints (`constraints`), and by kind:
        "constraints": dict(sum((s.constraints for s in sources), Counter())),
        "truncated_at_cut": sum(s.truncated_at_cut for s in sources),
        "pii": {kind: pii[kind] for kind in PII_KINDS} if config.scrub else None,
        "formats": dict(formats),
        "train": len(splits["train"]),
        "eval": len(splits["eval"]),
        "eval_fallback": fallback_id,
        "seen_prompts": seen_prompts,
        "total_weight": weight_stats[0],
        "max_weight": weight_stats[1],
        "stopped_at_max_prompts": stopped_at_max,
        "unread_files": [str(p) for p in paths[len(sources):]],
        "sources": [{"name": s.name, "path": str(p),
                     **{k: s.counts[k] for k in ("read", "kept", "duplicates", "seen", *SKIP_REASONS, "blank_lines")},
                     "formats": dict(s.formats), "truncated_at_cut": s.truncated_at_cut, "stopped_at": s.stopped_at,
                     "damaged": s.damaged,
                     "examples": s.examples} for s, p in zip(sources, paths)],
        "config": asdict(config),
        "wall_s": round(wall_s, 1),
    })
    return report


def format_report(report: IngestReport, out_dir: str | Path | None = None) -> str:
    """The report as ingest prints it: the totals, what was skipped and why, and a line per source."""
    where = f" -> {out_dir}" if out_dir else ""
    lines = [f"ingest: {report['read']} records read from {len(report['sources'])} file(s){where} "
             f"in {report['wall_s']} s",
             f"  kept {report['kept']} unique prompts (train {report['train']}, eval {report['eval']}), "
             f"duplicates {report['duplicates']} (kept as weights, max {report['max_weight']})",
             f"  skipped: {format_counts(report)}"
             + (f" (each with its reason: {SKIPPED_FILE})" if any(report[r] for r in SKIP_REASONS) else "")]
    if report.get("constrained"):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(report["constraints"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  constrained traffic: {report['constrained']} record(s) decoded under constraints ({kinds})")
    if report.get("with_tools"):
        lines.append(f"  tool-calling traffic: {report['with_tools']} record(s) with tool calls, results or "
                     f"definitions")
    if report["config"].get("exclude_ids") is not None:
        lines.append(f"  seen before: {report['seen']} record(s) of {report['seen_prompts']} prompt(s) an earlier "
                     f"ingest took (--exclude-ids), not ingested again (their ids: {SEEN_IDS_FILE})")
    if report["eval_fallback"]:
        lines.append(f"  no record fell under the eval fraction: eval holds the lowest-hash record "
                     f"{report['eval_fallback']}")
    if report["truncated_at_cut"] or any(s["stopped_at"] for s in report["sources"]):
        lines.append(f"  cut off: {report['truncated_at_cut']} partial record(s) at the end of a file")
    if report["stopped_at_max_prompts"]:
        lines.append(f"  stopped at --max-prompts; not read: {', '.join(report['unread_files']) or 'the rest'}")
    pii = report["pii"]
    lines.append("  pii replaced: " + ((", ".join(f"{k} {v}" for k, v in pii.items() if v) or "none")
                                       if pii is not None else "scrubbing off (--no-scrub)"))
    name_w = max(6, *(len(s["name"]) for s in report["sources"]))
    header = f"  {'source':<{name_w}} {'read':>8} {'kept':>8} {'dups':>8} {'bad':>6} {'too_long':>8}  formats"
    lines.append(header)
    for s in report["sources"]:
        bad = sum(s[r] for r in BAD_REASONS)
        formats = ", ".join(f"{k} {v}" for k, v in s["formats"].items())
        lines.append(f"  {s['name']:<{name_w}} {s['read']:>8} {s['kept']:>8} {s['duplicates']:>8} {bad:>6} "
                     f"{s['too_long'] + s['template_error']:>8}  {formats}")
        if s["stopped_at"]:
            lines.append(f"    stopped at {s['stopped_at']}")
        for damage in s["damaged"]:
            lines.append(f"    damaged: {damage}")
    return "\n".join(lines)
