"""`dflash-train refresh`: a round of new logs against the drafter serving now, released only when it beats it.

    dflash-train refresh LOG ... --serving DRAFTER [--serving-revision REV] --repo ORG/NAME [--no-push] --out DIR

The refresh folder (--out) holds the ledger of its rounds (rounds.json, `refresh.rounds`) and a folder per round
(round-001, ...) with what each stage wrote for it. A round is the content of its logs: the same logs again resume
their round, or find it done, and never make a second one; other logs make the next round. Each stage runs as its
own command, as `make demo` runs them (`support.runs.run_stage`): a stage whose folder is complete is skipped on a
rerun, so a round killed anywhere reruns to the same result, and every measurement and decision is in the ledger.

A round, stage by stage (each folder under round-NNN/):
  prompts        the logs' prompts that no earlier round ingested (`ingest --exclude-ids` with the ids the ledger
                 holds), split by the ledger's rule (the first round's); the ledger keeps the new ids by split and
                 the seen ones
  drift          before any training: the serving drafter's tau in vLLM on the new held-out requests against the tau
                 its card states (`decisions.drift`), by constraint kind
  store, run     the target's answers to the new training prompts, tapping the serving drafter's layers; the
                 candidate, warm-started from the serving drafter (`drafter.init_from`), trained on them with a
                 bounded replay of earlier rounds' stores (`data.replay_stores`, at most --replay-fraction of the new
                 samples), so what the drafter knew is not forgotten
  eval-new       the candidate and the serving drafter side by side in one vLLM eval on the new held-out requests
  eval-round-NNN the same on each of the latest earlier rounds' held-out requests (--earlier-rounds)
  release        `decisions.decide`; where it releases, push (its own gate: lossless, min tau) with a card listing the
                 rounds: a new revision of --repo, or with --no-push the release folder alone, which serves the next
                 round as a folder
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_train.errors import UserError
from dflash_train.options import add_options, at_least, from_args, in_range, integer_at_least, option
from dflash_train.prompts import write_ids
from dflash_train.provenance import LOCK_FILE, PROVENANCE_FILE, OutputClaim, is_complete, read_json, write_json_atomic
from dflash_train.refresh import decisions
from dflash_train.refresh.rounds import LEDGER_FILE, Ledger, Round, SplitRule, hash_logs, ingested_ids, load
from dflash_train.stages.push.command import PUSHED_FILE, repo_id_problem
from dflash_train.stages.capture.config import CaptureConfig
from dflash_train.stages.ingest.config import IngestConfig
from dflash_train.support import runs

STAGE = "refresh"
KNOWN_IDS_FILE = "known_ids.txt"  # in a round's folder: the ids earlier rounds ingested (its --exclude-ids)
HISTORY_FILE = "card_rounds.json"  # in a round's folder: the rounds its release's card lists (push --history)
ROUND_FOLDER = re.compile(r"round-\d{3,}")
EVAL_CONCURRENCY = 2  # the evals' one concurrency run beside batch 1 (eval takes at least one): two prompts together
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
    capture_engine: Literal["own", "vllm"] = option("vllm", help="who answers the training prompts at capture "
                                                                 "(capture --engine): vLLM, which the evals need "
                                                                 "anyway, or the one-pass loop")
    recipe: str = option("recipes/smollm2-135m-adapt.yaml", help="the training recipe; its drafter.init_from is the "
                                                                  "serving drafter (a warm start from it)")
    train_override: list[str] = option(default_factory=list, metavar="KEY=VALUE",
                                       help="recipe override, repeatable (e.g. train.time_budget_s=600)")
    replay_fraction: float = option(0.5, check=in_range(0, 10),
                                    help="earlier rounds' training samples replayed beside the new ones, at most this "
                                         "fraction of the new ones (chosen by a hash of their ids: stable)")
    repo: str | None = option(None, metavar="ORG/NAME", check=lambda v: v and repo_id_problem(v),
                              help="the Hub repo a released candidate is pushed to, a new revision of it (needed "
                                   "unless --no-push)")
    no_push: bool = option(False, help="release into the round's release folder only (as push --dry-run writes it): "
                                       "the next round serves that folder")
    eval_limit: int = option(20, check=integer_at_least(2),
                             help="held-out requests of each traffic (the new, each earlier round's) in each eval")
    eval_max_new_tokens: int = option(64, check=integer_at_least(1), help="tokens each eval request decodes")
    speculative_tokens: int | None = option(None, check=integer_at_least(1), metavar="K",
                                            help="the K of every eval (default: the K the serving drafter's card "
                                                 "states, else its block's B - 1; at most either drafter's B - 1)")
    earlier_rounds: int = option(3, check=integer_at_least(0), metavar="N",
                                 help="the earlier traffic the candidate is judged on: the held-out requests of the "
                                      "latest N earlier rounds (an eval each)")
    tolerance: float = option(decisions.TOLERANCE, check=in_range(0, 1),
                              help="the release's bound on the earlier traffic: the candidate's tau there at least "
                                   "(1 - tolerance) x the serving drafter's")
    until: Literal["ingest", "drift", "train", "release"] = option(
        "release", help="run the round up to this stage and stop (a rerun of the same command goes on from there)")
    eval_override: list[str] = option(default_factory=list, metavar="FLAG",
                                      help="an extra eval flag, repeatable (e.g. --eval-override=--dtype=fp32)")


@dataclass
class Serving:
    """The drafter serving now: as the ledger records it, its folder on this machine, its block, the target layers
    it reads (what capture taps for a warm start from it) and its card's eval summary (None: it has none)."""
    record: dict[str, Any]
    folder: Path
    block_size: int
    layers: list[int]
    card: Any  # eval_report.EvalReport | None


def refresh(logs: list[str], config: RefreshConfig) -> Round:
    """Run or resume the round of `logs` in the refresh folder; returns the round as the ledger records it. The
    folder is claimed for the run (provenance.OutputClaim): a second refresh into it is refused while this one
    runs."""
    if not config.no_push and not config.repo:
        raise UserError("refresh needs --repo ORG/NAME (where a released candidate is pushed), or --no-push")
    hashed = hash_logs(logs)
    out = Path(config.out).resolve()  # the stages run from the checkout's root
    serving = serving_drafter(config.serving, config.serving_revision)
    with OutputClaim(out, STAGE, legacy=is_refresh_folder):
        ledger = load(out)
        rnd = ledger.begin(hashed, serving.record, SplitRule(config.eval_fraction, config.seed, config.scrub))
        recorded = ledger.find(rnd.id) is not None
        print(f"refresh: {rnd.name} of {out} ({'resumed' if recorded else 'new'}): logs "
              f"{', '.join(log.name for log in rnd.logs)}; serving drafter {config.serving}", flush=True)
        if rnd.release is not None:
            print(f"refresh: {rnd.name} is done (these logs made it): {release_line(rnd.release)}; no new round",
                  flush=True)
            return rnd
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
        if config.until == "ingest":
            return stopped(rnd, "ingest")
        if not rnd.eval or not rnd.train:
            why = "no new held-out prompt to judge a candidate on" if not rnd.eval else "no new training prompt"
            ledger.record_release(rnd, {"released": False, "reasons": [why]})
            print(f"refresh: {rnd.name} has {why}: nothing to train, the serving drafter stays", flush=True)
            return rnd
        k = speculation_length(config, serving)
        measure_drift(config, ledger, rnd, serving, prompts, k, folder / "drift", log)
        if config.until == "drift":
            return stopped(rnd, "drift")
        store, run = folder / "store", folder / "run"
        runs.run_stage("capture", store, runs.capture_command(
            prompts, store, "train", config.capture_limit, config.max_prompt_tokens or CAPTURE_MAX_PROMPT_TOKENS,
            config.max_new_tokens, ["--target", here(config.target), "--layers", ",".join(map(str, serving.layers)),
                                    "--engine", config.capture_engine], config.batch_size), log)
        runs.run_stage("train", run / "drafter", runs.train_command(here(config.recipe), run, [
            f"data.stores=[{store}]", *replay(config, ledger, rnd, store), *warm_start(config, serving.record),
            *config.train_override]), log, {"WANDB_MODE": "disabled"})
        candidate = run / "drafter"
        if config.until == "train":
            return stopped(rnd, "train", f": the candidate is {candidate}")
        k = min(k, read_block_size(candidate) - 1)
        new = compare(config, ledger, rnd, "new", candidate, serving, prompts, k, folder / "eval-new", log)
        judged = [r for r in ledger.rounds if r.number < rnd.number and r.eval
                  and is_complete(out / r.name / "prompts")][-config.earlier_rounds:] if config.earlier_rounds else []
        earlier = [compare(config, ledger, rnd, r.name, candidate, serving, out / r.name / "prompts", k,
                           folder / f"eval-{r.name}", log) for r in judged]
        decision = decisions.decide(new, earlier, config.tolerance)
        print(f"\nrefresh: {rnd.name}: {decision.line()}", flush=True)
        release = {"released": False, "reasons": decision.reasons}
        if decision.release:
            release = publish(config, ledger, rnd, candidate, folder, decision, log)
        ledger.record_release(rnd, release)
    print(f"refresh: {rnd.name}: {release_line(rnd.release)}", flush=True)
    return rnd


def stopped(rnd: Round, stage: str, note: str = "") -> Round:
    print(f"refresh: {rnd.name} stops after its {stage} (--until {stage}){note}; the same command without --until "
          f"goes on from there", flush=True)
    return rnd


def release_line(release: dict[str, Any]) -> str:
    if release.get("released"):
        where = release.get("repo") and f"{release['repo']} at revision {release.get('revision')}"
        return f"released as {where or 'the folder ' + str(release.get('folder'))}"
    return "not released, the serving drafter stays: " + "; ".join(release.get("reasons") or [])


def speculation_length(config: RefreshConfig, serving: Serving) -> int:
    """The K of the round's evals: --speculative-tokens, else the K the serving drafter's card states, else its
    block's B - 1; at most its B - 1 (the candidate's is applied after training)."""
    card_k = serving.card.vllm.best_k if serving.card is not None and serving.card.vllm is not None else None
    return min(config.speculative_tokens or card_k or serving.block_size - 1, serving.block_size - 1)


def eval_stage(config: RefreshConfig, drafter: Path, baseline: Path | None, prompts: Path, k: int, out: Path,
               log: runs.Log, name: str) -> Any:
    """One vLLM eval of the round (the drafter alone, or beside a baseline drafter: paired by prompt), its report."""
    runs.run_stage(name, out, runs.eval_command(
        [drafter, *([baseline] if baseline else [])], prompts, config.eval_limit,
        config.max_prompt_tokens or CAPTURE_MAX_PROMPT_TOKENS, config.eval_max_new_tokens, None, out, "vllm",
        ["--target", here(config.target), "--speculative-tokens", str(k), "--concurrency", str(EVAL_CONCURRENCY),
         *config.eval_override]), log)
    return runs.read_report(out, own=False)


def measure_drift(config: RefreshConfig, ledger: Ledger, rnd: Round, serving: Serving, prompts: Path, k: int,
                  out: Path, log: runs.Log) -> None:
    """The serving drafter on the round's new held-out requests, before any training: did the traffic move?"""
    from dflash_train import constraints
    from dflash_train.prompts import load_prompts

    report = eval_stage(config, serving.folder, None, prompts, k, out, log, "drift (the serving drafter)")
    kinds = {row["id"]: constraints.kind(constraints.loads(row.get("constraints")))
             for row in load_prompts(prompts, "eval")}
    found = decisions.drift(serving.card, report.vllm, kinds)
    ledger.record_figure(rnd, "drift", found.record())
    print(f"\nrefresh: {rnd.name}: {found.line()}", flush=True)


def compare(config: RefreshConfig, ledger: Ledger, rnd: Round, traffic: str, candidate: Path, serving: Serving,
            prompts: Path, k: int, out: Path, log: runs.Log) -> decisions.Comparison:
    """The candidate and the serving drafter side by side on one traffic's held-out requests, recorded."""
    report = eval_stage(config, candidate, serving.folder, prompts, k, out, log,
                        f"eval ({traffic} traffic: the candidate beside the serving drafter)")
    found = decisions.comparison(traffic, report.vllm)
    ledger.record_figure(rnd, f"against serving ({traffic})", found.record())
    print(f"\nrefresh: {rnd.name}: {found.line()}", flush=True)
    return found


def replay(config: RefreshConfig, ledger: Ledger, rnd: Round, store: Path) -> list[str]:
    """The recipe overrides that replay earlier rounds' stores beside the new one: at most --replay-fraction of the
    new samples (none in the first round, or with --replay-fraction 0)."""
    earlier = [ledger.path.parent / r.name / "store" for r in ledger.rounds if r.number < rnd.number]
    earlier = [s for s in earlier if is_complete(s)]
    bound = int(config.replay_fraction * len(runs.store_ids(store)))
    if not earlier or bound < 1:
        return []
    return [f"data.replay_stores=[{','.join(map(str, earlier))}]", f"data.replay_samples={bound}"]


def publish(config: RefreshConfig, ledger: Ledger, rnd: Round, candidate: Path, folder: Path,
            decision: decisions.Decision, log: runs.Log) -> dict[str, Any]:
    """Push the released candidate with a card listing the rounds (push's own gate judges it too): the release
    folder always (push --dry-run), then the Hub repo unless --no-push. What was released, and where."""
    history = folder / HISTORY_FILE
    write_json_atomic(history, {"rounds": card_history(ledger, rnd, decision)})
    release, repo = folder / "release", config.repo or f"local/{ledger.path.parent.name}"
    args = ["--history", str(history)]
    code = runs.run_stage("release (push --dry-run: the gate and the card)", release, runs.push_command(
        candidate, repo, folder / "eval-new", release, [*args, "--dry-run"]), log, rerun=True, verdict_exit=2)
    if code == 2:
        gate = read_json(release / PROVENANCE_FILE, "the release's provenance").get("gate") or {}
        return {"released": False, "reasons": [*decision.reasons, "push's gate refused it: "
                                                + "; ".join(gate.get("reasons") or ["see the push's output"])]}
    if config.no_push:
        return {"released": True, "reasons": decision.reasons, "folder": f"{rnd.name}/release"}
    runs.run_stage("release (push)", release, runs.push_command(candidate, repo, folder / "eval-new", release, args),
                   log, rerun=True)
    commit = read_json(release / PUSHED_FILE, "what the release's push uploaded").get("commit")
    return {"released": True, "reasons": decision.reasons, "repo": repo, "revision": commit}


def card_history(ledger: Ledger, rnd: Round, decision: decisions.Decision) -> list[dict[str, str]]:
    """The rounds as the released card lists them (push --history): every recorded round up to this one, its logs,
    its new prompts, its drift and how its candidate compared with the drafter serving then."""
    rows = []
    for r in ledger.rounds:
        if r.number > rnd.number:
            break
        figures = r.figures or {}
        drift = figures.get("drift") or {}
        new = figures.get("against serving (new)") or {}
        earlier = [v for key, v in figures.items() if key.startswith("against serving (round-")]
        release = r.release if r is not rnd else {"released": decision.release}
        rows.append({
            "round": str(r.number),
            "logs": ", ".join(f"{log.name} (sha256 {log.sha256[:12]})" for log in r.logs),
            "new prompts": f"{len(r.train)} train, {len(r.eval)} held out; {len(r.seen)} seen before",
            "serving drafter": str(r.serving.get("repo") or r.serving.get("name"))
                               + (f"@{str(r.serving['revision'])[:12]}" if r.serving.get("revision") else ""),
            "drift": (f"{drift.get('verdict')}: tau {_num(drift.get('tau'))} against its card's "
                      f"{_num(drift.get('card_tau'))}") if drift else "not measured",
            "new traffic": _against(new),
            "earlier traffic": "; ".join(f"{v['traffic']}: {_against(v)}" for v in earlier) or "none",
            "released": "yes" if (release or {}).get("released") else "no",
        })
    return rows


def _num(x: Any) -> str:
    return "?" if x is None else f"{x:.2f}"


def _against(c: dict[str, Any]) -> str:
    if not c:
        return "not measured"
    iv = c.get("tau_ratio_interval")
    return (f"tau {_num(c.get('tau_candidate'))} vs {_num(c.get('tau_serving'))}, x{_num(c.get('tau_ratio'))}"
            + (f" [{_num(iv[0])}, {_num(iv[1])}]" if iv else "") + f" ({c.get('prompts')} requests, K {c.get('k')})")


def read_block_size(drafter: Path) -> int:
    """A drafter folder's block size, from its config.json (checkpoint.read_config: no weights read)."""
    from dflash_train.model.checkpoint import read_config

    return int(read_config(drafter).block_size)


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


def serving_drafter(source: str, revision: str | None) -> Serving:
    """The serving drafter, read and checked as the warm start will read it: as the ledger records it
    (`published.DrafterSource.record`: its Hub repo and the commit the revision resolved to, or its folder's name;
    its layout and its weights' sha256), its folder, block and taps, and its card's eval summary (eval/summary.json,
    as push publishes it)."""
    from dflash_train import eval_report
    from dflash_train.model.published import fetch_drafter, read_drafter

    drafter = read_drafter(fetch_drafter(source, revision, what="--serving"))
    summary = drafter.source.folder / "eval" / "summary.json"
    if not summary.exists() and drafter.source.repo:
        from huggingface_hub import hf_hub_download

        try:
            summary = Path(hf_hub_download(drafter.source.repo, "eval/summary.json", revision=drafter.source.revision))
        except Exception:  # a drafter published without an eval: its card states no tau, drift is unknown
            pass
    card = eval_report.load(summary) if summary.exists() else None
    return Serving(record=drafter.source.record(), folder=drafter.source.folder,
                   block_size=int(drafter.config.block_size), layers=list(drafter.config.target_layer_ids), card=card)


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
