"""`dflash-train refresh`: a round of new logs against the drafter serving now.

    dflash-train refresh LOG ... --serving DRAFTER [--serving-revision REV] --out data/refresh/app

The refresh folder (--out) holds the ledger of its rounds (rounds.json, `refresh.rounds`) and a folder per round
(round-001, ...) with what each stage wrote for it. A round is the content of its logs: the same logs again resume
their round, or find it done, and never make a second one; other logs make the next round. Each stage runs as its
own command, as `make demo` runs them (`support.runs.run_stage`): a stage whose folder is complete is skipped on a
rerun, so a round killed anywhere reruns to the same result.

This version runs a round's first stage and records it:
  ingest   the logs' prompts that no earlier round ingested (`dflash-train ingest --exclude-ids` with the ids the
           ledger holds), split by the ledger's rule (the first round's); the ledger keeps the new ids by split and
           the seen ones
The stages after it (the serving drafter's drift, capture with a bounded replay of earlier rounds, the warm start
from the serving drafter, the paired eval against it, the release) are the next steps of issue 61; the command says
where the round stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.options import add_options, from_args, option
from dflash_train.prompts import write_ids
from dflash_train.provenance import LOCK_FILE, OutputClaim, is_complete
from dflash_train.refresh.rounds import LEDGER_FILE, Round, SplitRule, hash_logs, ingested_ids, load
from dflash_train.stages.ingest.config import IngestConfig
from dflash_train.support import runs

STAGE = "refresh"
KNOWN_IDS_FILE = "known_ids.txt"  # in a round's folder: the ids earlier rounds ingested (its --exclude-ids)
ROUND_FOLDER = re.compile(r"round-\d{3,}")
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("a round enters the ledger (rounds.json) once its ingest is done, and each stage's folder is complete "
               "or marked incomplete: rerun the same command to resume the round")
SPLIT_NOTE = "; every round of a refresh folder keeps the first round's"


def _ingest_option(name: str, note: str = "") -> Any:
    """Ingest's own option (its default, help and check), which the round's ingest is given as it is."""
    f = next(f for f in dataclasses.fields(IngestConfig) if f.name == name)
    return option(f.default, help=f.metadata["help"] + note, check=f.metadata["check"])


@dataclass
class RefreshConfig:
    """The refresh command's options (besides the log files); the flags are derived from these fields."""
    out: str = option(help="the refresh folder: its ledger of rounds (rounds.json) and a folder per round")
    serving: str = option(help="the drafter serving now: a drafter folder or a Hub repo id (org/name)")
    serving_revision: str | None = option(None, help="the Hub revision of --serving (branch, tag or commit; default "
                                                     "main): the ledger records the commit it resolved to")
    target: str = _ingest_option("target")
    eval_fraction: float = _ingest_option("eval_fraction", SPLIT_NOTE)
    seed: int | None = _ingest_option("seed", SPLIT_NOTE)
    scrub: bool = _ingest_option("scrub", SPLIT_NOTE)
    max_prompt_tokens: int = _ingest_option("max_prompt_tokens")


def refresh(logs: list[str], config: RefreshConfig) -> Round:
    """Run or resume the round of `logs` in the refresh folder; returns the round as the ledger records it. The
    folder is claimed for the run (provenance.OutputClaim): a second refresh into it is refused while this one
    runs."""
    hashed = hash_logs(logs)
    out = Path(config.out).resolve()  # the stages run from the checkout's root
    serving = serving_record(config.serving, config.serving_revision)
    with OutputClaim(out, STAGE, legacy=is_refresh_folder):
        ledger = load(out)
        rnd = ledger.begin(hashed, serving, SplitRule(config.eval_fraction, config.seed, config.scrub))
        recorded = ledger.find(rnd.id) is not None
        print(f"refresh: {rnd.name} of {out} ({'resumed' if recorded else 'new'}): logs "
              f"{', '.join(log.name for log in rnd.logs)}; serving drafter {config.serving}", flush=True)
        folder, log = out / rnd.name, runs.Log()
        prompts = folder / "prompts"
        if recorded and is_complete(prompts):  # the ledger holds its result: whatever paths the logs have now
            print(f"\n=== ingest: {prompts} is complete and recorded in the ledger, skipping", flush=True)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            write_ids(folder / KNOWN_IDS_FILE, ledger.known_ids(rnd))
            runs.run_stage("ingest", prompts, runs.ingest_command(
                prompts, [str(Path(p).resolve()) for p in logs], ingest_options(config, folder / KNOWN_IDS_FILE)),
                log)
            ledger.record_ingest(rnd, *ingested_ids(prompts))
    print(f"\nrefresh: {rnd.name}: {len(rnd.train) + len(rnd.eval)} new prompt(s) (train {len(rnd.train)}, eval "
          f"{len(rnd.eval)}), {len(rnd.seen)} seen in earlier rounds, all recorded in {ledger.path}\n"
          f"refresh: this version stops after a round's ingest (the drift, capture, warm start, paired eval and "
          f"release are not built yet)", flush=True)
    return rnd


def ingest_options(config: RefreshConfig, known_ids: Path) -> list[str]:
    """The round's ingest: the refresh's own ingest options, and the ids earlier rounds took, excluded."""
    target = Path(config.target)
    return ["--target", str(target.resolve()) if target.is_dir() else config.target,
            "--eval-fraction", str(config.eval_fraction), *(["--seed", str(config.seed)] if config.seed is not None
                                                            else []),
            *([] if config.scrub else ["--no-scrub"]), "--max-prompt-tokens", str(config.max_prompt_tokens),
            "--exclude-ids", str(known_ids)]


def serving_record(source: str, revision: str | None) -> dict[str, Any]:
    """The serving drafter as the ledger records it (`published.DrafterSource.record`: its Hub repo and the commit
    the revision resolved to, or its folder's name; its layout and its weights' sha256), read and checked as a warm
    start from it will read it."""
    from dflash_train.model.published import fetch_drafter, read_drafter

    return read_drafter(fetch_drafter(source, revision, what="--serving")).source.record()


def is_refresh_folder(out: Path) -> bool:
    """A refresh folder records no stage of its own (it is never complete): it is known by what it holds, its
    ledger and its rounds' folders."""
    own = (LEDGER_FILE, LEDGER_FILE + ".tmp", LOCK_FILE)
    return all(p.name in own or (p.is_dir() and ROUND_FOLDER.fullmatch(p.name)) for p in out.iterdir())


# ----------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="the new logs (.jsonl, .jsonl.gz, .json or .parquet, as ingest reads them)")
    add_options(parser, RefreshConfig)


def run(args: argparse.Namespace) -> int:
    refresh(args.logs, from_args(RefreshConfig, args))
    return 0
