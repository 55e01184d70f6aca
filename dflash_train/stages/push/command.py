"""`dflash-train push`: write the model card and upload a trained drafter to the Hugging Face Hub.

    dflash-train push runs/NAME/drafter --repo ORG/NAME --eval-report eval/NAME [--private] [--revision BRANCH]
                      [--min-tau X] [--dry-run] [--force] [--out DIR]

1. Gate: refuse (exit 2) without an eval report, when its lossless check failed, or when its online tau (tau_steps:
   tokens per verification over all steps, the project's loop's and vLLM's) is below the minimum (--min-tau, else
   the recipe's push.min_tau, else DEFAULT_MIN_TAU). --force pushes anyway and the card says so.
2. Assemble the folder to upload (default push/<repo name>): the drafter's files, README.md (the card), the eval
   summary and plots (aggregates only: per-prompt records stay local). provenance.json stays local too.
3. Upload it with huggingface_hub: create_repo(exist_ok=True), upload_folder as one commit, each step retried
   with backoff on transient errors. --dry-run stops after step 2 and never touches the network; it exits as the
   real push would at the gate (2, in one line, where step 1 would refuse; --force still overrides).

The token comes from HF_TOKEN or the cached login (`hf auth login`) and is never printed: every message that
leaves this module goes through `redact`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from dflash_train import eval_report
from dflash_train.stages.push.card import DEFAULT_LICENSE, CardInputs, DataCounts, Gate, render_card, without_text
from dflash_train.errors import UserError, writing
from dflash_train.eval_report import DrafterRecord, EvalReport, OwnLoop, ReportJson, VllmEval
from dflash_train.model.checkpoint import (DrafterFolder, DrafterIdentity, TrainingArgs, drafter_identity,
                                           read_drafter_folder, weight_files)
from dflash_train.options import add_options, at_least, from_args, option
from dflash_train.provenance import (INCOMPLETE_MARKER, LOCK_FILE, PROVENANCE_FILE, OutputClaim, complete_output,
                                     StageConfig, config_differences, provenance, read_json, shown_pair,
                                     start_output, without_local_paths, write_json_atomic, write_provenance)
from dflash_train.store.format import Generation
from dflash_train.target import TargetIdentity, TargetRecord

# A drafter that commits fewer than 1.5 tokens per verification accepts a draft token at most every other step:
# not worth a release. Recipes set their own bar with push.min_tau; --min-tau overrides both.
DEFAULT_MIN_TAU = 1.5
STAGE = "push"
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("the upload is one commit, so the Hub has all of this push or none of it; rerun the same command to "
               "push (it writes the folder again)")
PUSHED_FILE = "pushed.json"  # after an upload: the repo, branch and commit it made (refresh records the revision)
LOCAL_ONLY = [PROVENANCE_FILE, PUSHED_FILE, INCOMPLETE_MARKER, LOCK_FILE, "*.tmp"]  # beside the upload, never in it
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
TRANSIENT_ERRORS = {"TransportError", "TimeoutException", "NetworkError", "ConnectError", "ReadError",
                    "WriteError", "RemoteProtocolError", "ConnectionError", "Timeout", "ReadTimeout"}
# What a git branch name may not hold (git check-ref-format --branch; the Hub's branches are git refs, and
# huggingface_hub has no validator of its own for them): spaces and control characters, ~ ^ : ? * [ \, ".." or "@{"
_NOT_IN_A_BRANCH = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a Hub model repo id of the form ORG/NAME, or None: huggingface_hub's own validator
    (the characters the Hub takes, no "--" or "..", at most 96 characters a part, ...). The check of --repo, made
    before anything is read or written, dry run included."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if repo_id.count("/") != 1:
        return "is not a Hub repo id of the form ORG/NAME"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        return f"is not a Hub repo id: {err}"
    return None


def branch_problem(name: str | None) -> str | None:
    """Why `name` is not a branch name git accepts (git check-ref-format --branch), or None. The check of
    --revision, made before anything is read or written."""
    if name is None:
        return None
    if (_NOT_IN_A_BRANCH.search(name) or name.startswith("-") or name.endswith(".")
            or any(not part or part.startswith(".") or part.endswith(".lock") for part in name.split("/"))):
        return ('is not a branch name git accepts (git check-ref-format: no space, control character, ~ ^ : ? * [ '
                '\\, ".." or "@{"; no empty part, none starting with "." or ending in ".lock"; not starting with "-" '
                'or ending in ".")')
    return None


@dataclass
class PushConfig:
    """The push stage's options; the `dflash-train push` arguments are derived from these fields."""
    drafter: str = option(metavar="DRAFTER_DIR", help="a trained drafter folder (runs/NAME/drafter)")
    repo: str = option(metavar="ORG/NAME", check=repo_id_problem, help="Hub model repo to push to")
    private: bool = option(False, help="create the repo private (if it does not exist)")
    revision: str | None = option(None, metavar="BRANCH", check=branch_problem,
                                  help="push to this branch (created from main if needed)")
    eval_report: str | None = option(None, metavar="DIR",
                                     help="the eval folder (or its report.json) for this drafter")
    min_tau: float | None = option(None, check=at_least(1), metavar="X",
                                   help=f"minimum acceptance length to push (default: the recipe's push.min_tau, "
                                        f"else {DEFAULT_MIN_TAU})")
    dry_run: bool = option(False, help="write the folder and list its files; no network; exit 2 where the gate "
                                       "would refuse the real push")
    force: bool = option(False, help="push even if the gate refuses; the card says so")
    out: str | None = option(None, metavar="DIR", help="where the folder to upload is assembled "
                                                       "(default: push/<repo name>)")
    history: str | None = option(None, metavar="FILE", help="the refresh rounds that led to this drafter, as "
                                                            "`dflash-train refresh` writes them (JSON {\"rounds\": "
                                                            "[one object of strings per round]}): the card lists them")
    retries: int = option(4, check=at_least(1), help="attempts per Hub call on transient errors")
    retry_wait: float = option(2.0, check=at_least(0), metavar="S",
                               help="first backoff wait in seconds, doubled after each failed attempt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, PushConfig, positional=("drafter",))


# ---- reading the inputs -------------------------------------------------------------------------------------


def load_history(path: str | None) -> list[dict[str, str]] | None:
    """push --history: a JSON object whose "rounds" is a list of objects of strings (one per refresh round, the same
    keys in each: the card's table columns); anything else is one line naming the file."""
    if path is None:
        return None
    rows = read_json(Path(path), "the refresh rounds (--history)").get("rounds")
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and r and all(isinstance(k, str) and isinstance(v, str) for k, v in r.items())
            for r in rows):
        raise UserError(f"--history {path}: its \"rounds\" is not a non-empty list of objects of strings (one per "
                        f"round)")
    if any(list(r) != list(rows[0]) for r in rows):
        raise UserError(f"--history {path}: its rounds do not all have the same keys, in the same order")
    return rows


def load_report(path: str | None) -> tuple[EvalReport | None, Path | None]:
    if path is None:
        return None, None
    p = Path(path)
    report_file = p / "report.json" if p.is_dir() else p
    if report_file.exists() and (report_file.parent / INCOMPLETE_MARKER).exists():
        raise UserError(f"eval folder {report_file.parent} is marked incomplete: the eval did not finish "
                        f"(rerun it)")
    return eval_report.load(report_file), report_file


def recipe_of(training_args: TrainingArgs | None) -> StageConfig | None:
    if not training_args:
        return None
    recipe = training_args.get("recipe", training_args)
    return recipe if isinstance(recipe, dict) else None


def recipe_min_tau(recipe: StageConfig | None) -> float | None:
    if not recipe:
        return None
    push = recipe.get("push")
    value = push.get("min_tau") if isinstance(push, dict) else None
    if value is None:
        value = recipe.get("min_tau")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def data_summary(training_args: TrainingArgs | None, recipe: StageConfig | None
                 ) -> tuple[DataCounts | None, Generation | None]:
    """The training data summary and the decoding settings the data was captured with.

    The trainer records each capture store's counts, decoding settings and ingest report in training_args.json
    (`data.stores`); for a training_args.json without them, the manifests of the recipe's stores are read if
    they are still on this machine. The card shows counts and names only (card.py filters everything else)."""
    recorded = (training_args or {}).get("data") if training_args and "recipe" in training_args else None
    recorded = recorded if isinstance(recorded, dict) else {}
    stores = [s for s in recorded.get("stores") or [] if isinstance(s, dict)]
    if not stores and recipe and isinstance(recipe.get("data"), dict):
        for path in recipe["data"].get("stores") or []:
            manifest = Path(path) / "manifest.json"
            if manifest.exists():
                stores.append({"path": str(path), **read_json(manifest, "a capture store manifest")})
    summary: DataCounts = {}
    if stores:
        summary["stores"] = [{"name": Path(str(s.get("path", "store"))).name,
                              **{k: s.get(k) for k in ("num_samples", "num_tokens", "storage_dtype",
                                                       "ingest_report")},
                              **({"replay": True} if s.get("replay") is True else {})}
                             for s in stores]
    totals = {k: v for k, v in recorded.items() if k != "stores"}
    if totals and len(stores) != 1:
        summary["recorded"] = totals
    generation = next((s["generation"] for s in stores if isinstance(s.get("generation"), dict)), None)
    return summary or None, generation


# ---- the gate -----------------------------------------------------------------------------------------------


def drafter_differences(report: EvalReport, drafter: DrafterFolder, identity: DrafterIdentity) -> list[str]:
    """Where the drafter the report measured (its `drafter` record, its block size) differs from this one, whose
    `identity` (checkpoint.drafter_identity) is what it is now."""
    measured = report.drafter
    config = drafter.config_json
    pairs = (("block_size", measured.block_size, config.get("block_size")),
             ("num_hidden_layers", measured.num_hidden_layers, config.get("num_hidden_layers")),
             ("target_layer_ids", measured.target_layer_ids or None,
              config["dflash_config"].get("target_layer_ids")),
             ("mask_token_id", measured.mask_token_id, config["dflash_config"].get("mask_token_id")))
    differences = [f"{key} {was} vs {now}" for key, was, now in pairs if was is not None and was != now]
    differences += identity_changes(measured, identity, drafter.dir)
    if report.block_size not in (0, config.get("block_size")):
        differences.append(f"eval block size {report.block_size} vs the drafter's {config.get('block_size')}")
    return differences


def identity_changes(measured: DrafterRecord, identity: DrafterIdentity, drafter_dir: Path) -> list[str]:
    """THE rule that binds a release to its eval: the drafter the eval recorded (`measured`, its
    checkpoint.drafter_identity) must be the one in `drafter_dir` now (`identity`), weights and config.json alike.
    One phrase per config key changed since the eval, and one for the weights."""
    if not isinstance(measured.config, dict) or not measured.weights_sha256:
        return ["it records no config.json and weights sha256 of the drafter (an eval made before both were "
                "recorded): evaluate this drafter again"]
    changes = [f"config.json {key} was {was} when evaluated, is {now} now" for key, old, new in
               config_differences(measured.config, identity["config"]) for was, now in [shown_pair(old, new)]]
    if measured.weights_sha256 != identity["weights_sha256"]:
        files = ", ".join(str(f) for f in weight_files(drafter_dir))
        changes.append(f"the weights in {files} are not the ones evaluated (sha256 differs)")
    return changes


def check_gate(report: EvalReport | None, report_file: Path | None, target: TargetRecord,
               drafter: DrafterFolder, min_tau: float, min_tau_source: str, force: bool) -> Gate:
    reasons = []
    if report is None:
        reasons.append("no eval report (pass --eval-report DIR; run `dflash-train eval` first)")
    else:
        identity = drafter_identity(drafter.dir)
        if report.own:  # the project's loop ran
            reasons += measured_reasons(report.own, f"{report_file}", "online tau", min_tau, min_tau_source)
        reasons += engine_reasons(report, report_file, drafter.dir, identity, min_tau, min_tau_source)
        if differences := drafter_differences(report, drafter, identity):
            reasons.append(f"{report_file} measured a different drafter or block size ({'; '.join(differences)})")
        if trained := training_prompts_evaluated(report):
            reasons.append(f"{report_file} evaluated {trained} prompts or samples the drafter was trained on "
                           f"(--training-prompts): its tau overstates the drafter; evaluate on held-out prompts")
        measured = report.target
        made_for = TargetIdentity.from_dict(target)
        if measured is not None and made_for is not None and not measured.matches(made_for):
            reasons.append(f"{report_file} measured another target ({measured.name}) than the one "
                           f"this drafter was trained for ({made_for.name})")
    return Gate(passed=not reasons, forced=force, min_tau=min_tau, min_tau_source=min_tau_source, reasons=reasons)


def training_prompts_evaluated(report: EvalReport) -> int:
    """How many of the evaluated prompts (and --store samples) the drafter was trained on (eval's
    held_out_check, where --training-prompts let them through)."""
    return sum(c.training_prompts for c in report.held_out_check.values())


def measured_reasons(measured: OwnLoop | VllmEval, where: str, what: str, min_tau: float, min_tau_source: str
                     ) -> list[str]:
    """The lossless check and the minimum tau (the headline tau_steps: tokens per verification over all steps), for
    the project's loop or vLLM."""
    reasons = []
    mismatches = measured.standing_mismatches()
    if mismatches is None:
        reasons.append(f"{where} has no lossless_mismatches count: the lossless check did not run"
                       + (f" ({measured.lossless_note})" if measured.lossless_note else ""))
    elif mismatches > 0:
        fp32 = " (still, when rerun in fp32)" if measured.lossless_mismatches_fp32 else ""
        reasons.append(f"the lossless check failed: {mismatches} outputs in {where} differ from the "
                       f"target's own decoding{fp32}")
    tau = measured.tau_steps
    if not isinstance(tau, (int, float)) or isinstance(tau, bool):
        reasons.append(f"{where} has no {what}")
    elif tau < min_tau:
        reasons.append(f"{what} {tau:.3f} is below the minimum {min_tau:g} ({min_tau_source})")
    return reasons


def engine_reasons(report: EvalReport, report_file: Path | None, drafter_dir: Path, identity: DrafterIdentity,
                   min_tau: float, min_tau_source: str) -> list[str]:
    """A release needs the serving engine's own eval of this very drafter (`identity`: checkpoint.drafter_identity,
    weights and config.json): vLLM loaded it as its dflash speculator, decoded losslessly and accepted enough
    drafts, at the speculation length the card serves it with (the entry's headline figures are its best_k's)."""
    engine = report.vllm
    if engine is None:
        return [f"{report_file} has no vLLM eval of this drafter (run `dflash-train eval --engine both`: the "
                f"engine users serve with must load it and accept its drafts)"]
    reasons = []
    if engine.drafter_sha256 != identity["sha256"]:
        why = "differs" if engine.drafter_sha256 else "not recorded: an eval made before it was"
        reasons.append(f"the vLLM eval in {report_file} measured another drafter than {drafter_dir} (the sha256 of "
                       f"its weights and config.json {why})")
    at_k = f" (K = {engine.best_k})" if engine.best_k else ""  # the K the card serves with
    return reasons + measured_reasons(engine, f"the vLLM eval in {report_file}", f"vLLM tau{at_k}", min_tau,
                                      min_tau_source)


def publishable_engine(engine: VllmEval, target_hub_id: str, repo_id: str) -> VllmEval:
    """vLLM's eval as it may be published: the local target and drafter folders in its arguments (and the combined
    speculator's) replaced by the Hub repos, the serve command rebuilt from them."""
    from dflash_train.engine.args import serve_command

    def on_the_hub(engine_args: dict[str, Any] | None) -> dict[str, Any]:
        args = dict(engine_args or {})
        if args:
            args["model"] = target_hub_id
            if isinstance(args.get("speculative_config"), dict):
                args["speculative_config"] = dict(args["speculative_config"], model=repo_id)
        return args

    args = on_the_hub(engine.engine_args)
    combined = engine.combined and replace(engine.combined, engine_args=on_the_hub(engine.combined.engine_args))
    return replace(engine, engine_args=args, engine_args_plain=on_the_hub(engine.engine_args_plain),
                   serve_command=serve_command(args) if args else None, combined=combined)


# ---- assembling the folder ----------------------------------------------------------------------------------


def without_records(obj: Any) -> Any:
    """`obj` without per-prompt / per-sample records (lists of objects with an "id"), at any depth."""
    if isinstance(obj, dict):
        return {k: without_records(v) for k, v in obj.items()
                if not (isinstance(v, list) and v and all(isinstance(x, dict) and "id" in x for x in v))}
    if isinstance(obj, list):
        return [without_records(v) for v in obj]
    return obj


def eval_summary(report: EvalReport, target_hub_id: str, repo_id: str) -> ReportJson:
    """What of the eval report is published (as report.json's JSON): aggregates and settings, no per-prompt
    records, no text, no local folder in the engine's arguments."""
    if report.vllm:
        report = replace(report, vllm=publishable_engine(report.vllm, target_hub_id, repo_id))
    return without_text(without_records(eval_report.to_json(report)))


def default_out(repo_id: str) -> Path:
    return Path("push") / repo_id.split("/")[-1]


def claim_out(out: Path) -> OutputClaim:
    """Claim `out` for this push: refused unless it is new, empty or a folder a push made (never wipe someone else's
    files), when another push is writing it, or when it is a symbolic link (its contents are replaced)."""
    return OutputClaim(out, STAGE, allow_symlink=False)


def prepare_out(out: Path) -> None:
    """Empty the claimed folder (its lock stays) and mark it incomplete."""
    for path in out.iterdir():
        if path.name == LOCK_FILE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    start_output(out, STAGE)


def assemble(out: Path, drafter: DrafterFolder, report: EvalReport | None, report_file: Path | None,
             card: CardInputs) -> list[Path]:
    prepare_out(out)
    for src in sorted(drafter.dir.iterdir()):
        if not src.is_file() or src.name in (PROVENANCE_FILE, INCOMPLETE_MARKER, "README.md") \
                or src.name.endswith(".tmp"):
            continue
        if src.name == "training_args.json":  # the ingest report quotes skipped log records: keep the counts only
            write_json_atomic(out / src.name, without_local_paths(without_text(drafter.training_args)))
        elif src.suffix == ".json":  # config.json names the target, perhaps by its local folder
            write_json_atomic(out / src.name, without_local_paths(read_json(src, "a drafter file")))
        else:
            shutil.copy2(src, out / src.name)
    if report is not None and report_file is not None:
        (out / "eval").mkdir()
        write_json_atomic(out / "eval" / "summary.json", without_local_paths(
            eval_summary(report, str(card.target.get("base_model")), card.repo_id)))
        for plot in sorted(report_file.parent.glob("*.png")):
            shutil.copy2(plot, out / "eval" / plot.name)
            card.plots.append(f"eval/{plot.name}")
    (out / "README.md").write_text(without_local_paths(render_card(card)))
    return upload_files(out)


def upload_files(out: Path) -> list[Path]:
    import fnmatch

    return sorted(p for p in out.rglob("*") if p.is_file()
                  and not any(fnmatch.fnmatch(p.name, pat) for pat in LOCAL_ONLY))


# ---- the upload ---------------------------------------------------------------------------------------------


def redact(text: str, token: str | None) -> str:
    text = re.sub(r"(Bearer\s+)[A-Za-z0-9_.~+/=-]+", r"\1***", text)
    if token:
        text = text.replace(token, "***")
    return re.sub(r"\bhf_[A-Za-z0-9]{8,}", "hf_***", text)


def is_transient(err: BaseException) -> bool:
    """5xx / 429 / timeouts / dropped connections, anywhere in the exception's cause chain."""
    seen: BaseException | None = err
    while seen is not None:
        response = getattr(seen, "response", None)
        if getattr(response, "status_code", None) in TRANSIENT_STATUS:
            return True
        if any(cls.__name__ in TRANSIENT_ERRORS for cls in type(seen).__mro__):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe(err: BaseException, token: str | None) -> str:
    """One line: the error type and message, with the server's explanation, the token redacted."""
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if len(message) > 400:
        message = message[:400] + " ..."
    return redact(f"{type(err).__name__}: {message}", token)


def with_retries(what: str, fn: Callable[[], Any], attempts: int, wait: float, token: str | None) -> Any:
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:
            if attempt == attempts or not is_transient(err):
                raise
            delay = wait * 2 ** (attempt - 1)
            print(f"{what} failed ({describe(err, token)}); retry {attempt}/{attempts - 1} in {delay:g} s",
                  file=sys.stderr, flush=True)
            time.sleep(delay)


def rerun_command(args: PushConfig, out: Path) -> str:
    cmd = ["dflash-train", "push", str(args.drafter), "--repo", args.repo, "--out", str(out)]
    if args.eval_report:
        cmd += ["--eval-report", str(args.eval_report)]
    if args.revision:
        cmd += ["--revision", args.revision]
    if args.min_tau is not None:
        cmd += ["--min-tau", f"{args.min_tau:g}"]
    cmd += [flag for flag, on in (("--private", args.private), ("--force", args.force)) if on]
    return shlex.join(cmd)


def upload(out: Path, args: PushConfig, run_name: str, gate: Gate) -> tuple[str, str | None]:
    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UserError("HF_HUB_OFFLINE is set, so huggingface_hub will not reach the Hub: unset it to push "
                        f"(the folder {out} is ready; --dry-run only writes it)")
    token = get_token()
    if not token:
        raise UserError("no Hugging Face token: set HF_TOKEN or run `hf auth login` "
                        f"(the folder {out} is ready to upload)")
    api = HfApi(token=token)
    message = f"Upload DFlash drafter from run {run_name}"
    description = "Pushed with `dflash-train push`" + (" --force: the release gate was overridden"
                                                     if gate.forced and not gate.passed else "") + "."
    attempts, wait = max(1, args.retries), args.retry_wait
    try:
        with_retries("create_repo", lambda: api.create_repo(args.repo, private=args.private, exist_ok=True,
                                                            repo_type="model"), attempts, wait, token)
        if args.private and not with_retries("repo_info", lambda: api.repo_info(args.repo), attempts, wait,
                                             token).private:
            print(f"warning: {args.repo} already exists and is public; --private does not change an existing "
                  f"repo (change its visibility in its settings)", file=sys.stderr)
        if args.revision and args.revision != "main":
            with_retries("create_branch", lambda: api.create_branch(args.repo, branch=args.revision,
                                                                    exist_ok=True), attempts, wait, token)
        commit = with_retries("upload", lambda: api.upload_folder(
            repo_id=args.repo, folder_path=str(out), revision=args.revision, commit_message=message,
            commit_description=description, ignore_patterns=list(LOCAL_ONLY)), attempts, wait, token)
    except Exception as err:
        raise UserError(f"upload to {args.repo} failed: {describe(err, token)}. The folder {out} is complete "
                        f"and unchanged; rerun: {rerun_command(args, out)}") from None
    return getattr(commit, "commit_url", None) or str(commit), getattr(commit, "oid", None)


def run(namespace: argparse.Namespace) -> int:
    args = from_args(PushConfig, namespace)  # --repo and --revision checked first: nothing read or written yet
    drafter = read_drafter_folder(args.drafter)
    report, report_file = load_report(args.eval_report)
    history = load_history(args.history)
    target = drafter.target or (report.target.to_dict() if report and report.target else None)
    if not isinstance(target, dict) or not target.get("base_model"):
        raise UserError(f"{Path(args.drafter) / 'config.json'} names no target (dflash_train.target.base_model): the "
                        f"card must name the target this drafter was trained for")
    recipe = recipe_of(drafter.training_args)
    if args.min_tau is not None:
        min_tau, source = args.min_tau, "--min-tau"
    elif (value := recipe_min_tau(recipe)) is not None:
        min_tau, source = value, "the training recipe's push.min_tau"
    else:
        min_tau, source = DEFAULT_MIN_TAU, "dflash-train's default"
    gate = check_gate(report, report_file, target, drafter, min_tau, source, args.force)
    verdict = "; ".join(gate.reasons)
    if not gate.passed and not args.force and not args.dry_run:
        raise UserError(f"refusing to push: {verdict}. Pass --force to push anyway (the card will say the gate "
                        f"was overridden)")
    if not gate.passed and args.force:
        print(f"gate overridden with --force: {verdict}", file=sys.stderr)

    run_name = (recipe or {}).get("name") or (drafter.dir.parent.name if drafter.dir.name == "drafter"
                                              else drafter.dir.name)
    license_ = (recipe or {}).get("license")
    summary, generation = data_summary(drafter.training_args, recipe)
    eval_prov = None
    if report_file is not None and (report_file.parent / PROVENANCE_FILE).exists():
        eval_prov = read_json(report_file.parent / PROVENANCE_FILE, "what made the eval report")
    push_prov = provenance()
    card = CardInputs(
        repo_id=args.repo, revision=args.revision, run_name=str(run_name), drafter_config=drafter.config_json,
        num_parameters=drafter.num_parameters, weights_dtype=drafter.dtype, target=target,
        license=str(license_ or DEFAULT_LICENSE), license_from_recipe=bool(license_), gate=gate, recipe=recipe,
        data=summary, generation=generation, report=report, run=(drafter.training_args or {}).get("run"),
        training_provenance=drafter.provenance, eval_provenance=eval_prov,
        push_provenance=push_prov, history=history)
    out = Path(args.out) if args.out else default_out(args.repo)
    with claim_out(out):
        with writing(out):
            files = assemble(out, drafter, report, report_file, card)
            write_provenance(out, config=asdict(args), stage=STAGE, drafter=str(drafter.dir),
                             eval_report=str(report_file) if report_file else None,
                             gate={"passed": gate.passed, "forced": gate.forced, "min_tau": gate.min_tau,
                                   "reasons": gate.reasons})
            complete_output(out)
        return _publish(out, files, args, run_name, gate, verdict)


def _publish(out: Path, files: list[Path], args: PushConfig, run_name: str, gate: Gate, verdict: str) -> int:
    """List the folder; upload it unless this is a dry run (the folder stays claimed until the upload ends)."""
    print(f"{out}/ ({'dry run: nothing uploaded' if args.dry_run else 'to upload to ' + args.repo}):")
    for f in files:
        print(f"  {f.relative_to(out)}  {f.stat().st_size:,} bytes")
    print(f"  ({PROVENANCE_FILE} stays local)")
    if args.dry_run:
        if not gate.passed and not args.force:  # the preview is written; its exit status is the real push's verdict
            raise UserError(f"dry run: a real push would be REFUSED: {verdict} (the preview is in {out}; pass "
                            f"--force to override)")
        return 0
    url, commit = upload(out, args, str(run_name), gate)
    write_json_atomic(out / PUSHED_FILE, {"repo": args.repo, "revision": args.revision or "main", "commit": commit,
                                          "url": url})
    print(f"pushed to {args.repo}" + (f"@{args.revision}" if args.revision else "") + f": {url}")
    return 0
