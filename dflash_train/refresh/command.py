"""`dflash-train refresh`: a round of new logs against the drafter serving now.

    dflash-train refresh LOG ... --serving DRAFTER [--serving-revision REV] --out data/refresh/app

The refresh folder (--out) holds the ledger of its rounds (rounds.json, `refresh.rounds`) and a folder per round
(round-001, ...) with what each stage wrote for it. A round is the content of its logs: the same logs again resume
their round, or find it done, and never make a second one; other logs make the next round. Each stage runs as its
own command, as `make demo` runs them (`support.runs.run_stage`): a stage whose folder is complete is skipped on a
rerun, so a round killed anywhere reruns to the same result.

This version runs a round's first stages:
  ingest   the logs' prompts that no earlier round ingested (`dflash-train ingest --exclude-ids` with the ids the
           ledger holds), split by the ledger's rule (the first round's); the ledger keeps the new ids by split and
           the seen ones
  capture  the target's answers to the round's new training prompts, tapping the serving drafter's layers
  train    the recipe, warm-started from the serving drafter (`drafter.init_from`): the candidate
The stages after them (the serving drafter's drift, a bounded replay of earlier rounds, the paired eval against the
serving drafter, the release) are the next steps of issue 61; the command says where the round stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_train.options import add_options, at_least, from_args, option
from dflash_train.prompts import write_ids
from dflash_train.provenance import LOCK_FILE, OutputClaim, is_complete
from dflash_train.refresh.rounds import LEDGER_FILE, Round, SplitRule, hash_logs, ingested_ids, load
from dflash_train.stages.capture.config import CaptureConfig
from dflash_train.stages.ingest.config import IngestConfig
from dflash_train.support import runs

STAGE = "refresh"
KNOWN_IDS_FILE = "known_ids.txt"  # in a round's folder: the ids earlier rounds ingested (its --exclude-ids)
ROUND_FOLDER = re.compile(r"round-\d{3,}")
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("a round enters the ledger (rounds.json) once its ingest is done, and each stage's folder is complete "
               "or marked incomplete: rerun the same command to resume the round")
SPLIT_NOTE = "; every round of a refresh folder keeps the first round's"
CAPTURE_MAX_PROMPT_TOKENS = next(f.default for f in dataclasses.fields(CaptureConfig) if f.name == "max_prompt_tokens")


def _stage_option(stage: type, name: str, note: str = "") -> Any:
    """A stage's own option (its default, help and check), which the round's stage is given as it is."""
    f = next(f for f in dataclasses.fields(stage) if f.name == name)
    return option(f.default, help=f.metadata["help"] + note, check=f.metadata["check"])


@dataclass
class RefreshConfig:
    """The refresh command's options (besides the log files); the flags are derived from these fields."""
    out: str = option(help="the refresh folder: its ledger of rounds (rounds.json) and a folder per round")
    serving: str = option(help="the drafter serving now: a drafter folder or a Hub repo id (org/name)")
    serving_revision: str | None = option(None, help="the Hub revision of --serving (branch, tag or commit; default "
                                                     "main): the ledger records the commit it resolved to")
    target: str = _stage_option(IngestConfig, "target")
    eval_fraction: float = _stage_option(IngestConfig, "eval_fraction", SPLIT_NOTE)
    seed: int | None = _stage_option(IngestConfig, "seed", SPLIT_NOTE)
    scrub: bool = _stage_option(IngestConfig, "scrub", SPLIT_NOTE)
    max_prompt_tokens: int = _stage_option(IngestConfig, "max_prompt_tokens")
    capture_limit: int = option(2000, check=at_least(1), help="the round's new training prompts captured, at most")
    max_new_tokens: int = _stage_option(CaptureConfig, "max_new_tokens")
    batch_size: int = _stage_option(CaptureConfig, "batch_size")
    capture_engine: Literal["own", "vllm"] = option("own", help="who answers the training prompts at capture "
                                                                "(capture --engine)")
    recipe: str = option("recipes/smollm2-135m-adapt.yaml", help="the training recipe; its drafter.init_from is the "
                                                                  "serving drafter (a warm start from it)")
    train_override: list[str] = option(default_factory=list, metavar="KEY=VALUE",
                                       help="recipe override, repeatable (e.g. train.max_steps=50)")


def refresh(logs: list[str], config: RefreshConfig) -> Round:
    """Run or resume the round of `logs` in the refresh folder; returns the round as the ledger records it. The
    folder is claimed for the run (provenance.OutputClaim): a second refresh into it is refused while this one
    runs."""
    hashed = hash_logs(logs)
    out = Path(config.out).resolve()  # the stages run from the checkout's root
    serving, layers = serving_drafter(config.serving, config.serving_revision)
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
              f"{len(rnd.eval)}), {len(rnd.seen)} seen in earlier rounds, all recorded in {ledger.path}", flush=True)
        if not rnd.train:
            print(f"refresh: {rnd.name} has no new training prompt: nothing to train, the serving drafter stays",
                  flush=True)
            return rnd
        store, run = folder / "store", folder / "run"
        runs.run_stage("capture", store, runs.capture_command(
            prompts, store, "train", config.capture_limit, config.max_prompt_tokens or CAPTURE_MAX_PROMPT_TOKENS,
            config.max_new_tokens, ["--target", here(config.target), "--layers", ",".join(map(str, layers)),
                                    "--engine", config.capture_engine], config.batch_size), log)
        runs.run_stage("train", run / "drafter", runs.train_command(here(config.recipe), run, [
            f"data.stores=[{store}]", *warm_start(config, serving), *config.train_override]), log,
            {"WANDB_MODE": "disabled"})
    print(f"refresh: {rnd.name}: the candidate, warm-started from the serving drafter: {run / 'drafter'}\n"
          f"refresh: this version stops there (the drift, replay, paired eval and release are not built yet)",
          flush=True)
    return rnd


def warm_start(config: RefreshConfig, serving: dict[str, Any]) -> list[str]:
    """The recipe overrides that start training from the serving drafter: its folder, or its Hub repo at the commit
    the ledger recorded."""
    if serving.get("repo"):
        return [f"drafter.init_from={serving['repo']}", f"drafter.init_revision={serving['revision']}"]
    return [f"drafter.init_from={here(config.serving)}"]


def here(path_or_name: str) -> str:
    """A file or folder of this machine resolved, as the stages get it (they run from the checkout's root); anything
    else (a target's name, a Hub repo id) as it is."""
    return str(Path(path_or_name).resolve()) if Path(path_or_name).exists() else path_or_name


def ingest_options(config: RefreshConfig, known_ids: Path) -> list[str]:
    """The round's ingest: the refresh's own ingest options, and the ids earlier rounds took, excluded."""
    return ["--target", here(config.target),
            "--eval-fraction", str(config.eval_fraction), *(["--seed", str(config.seed)] if config.seed is not None
                                                            else []),
            *([] if config.scrub else ["--no-scrub"]), "--max-prompt-tokens", str(config.max_prompt_tokens),
            "--exclude-ids", str(known_ids)]


def serving_drafter(source: str, revision: str | None) -> tuple[dict[str, Any], list[int]]:
    """The serving drafter as the ledger records it (`published.DrafterSource.record`: its Hub repo and the commit
    the revision resolved to, or its folder's name; its layout and its weights' sha256), and the target layers it
    reads (what capture taps for a warm start from it), read and checked as the warm start will read it."""
    from dflash_train.model.published import fetch_drafter, read_drafter

    drafter = read_drafter(fetch_drafter(source, revision, what="--serving"))
    return drafter.source.record(), list(drafter.config.target_layer_ids)


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
