"""The eval stage: real speculative decoding with the target on held-out prompts.

    dflash-train eval --drafter runs/x/drafter --target smollm2-135m-instruct --prompts data/prompts/sharegpt \\
        --split eval --out eval/x [--store data/store/heldout] [--baseline-drafter DIR ...]

For every prompt, in one run: plain target decoding (the reference and the tokens/s baseline), then the
speculative loop with the drafter, with each baseline drafter and with block size 1 (no speculation). Every
speculative output is compared with the plain one token by token (the lossless check). Acceptance length
(tau) of a verification step = 1 + the accepted drafts, at most B (spec_decode.loop.Step.tau); the reported tau
(tau_steps) is the mean over all steps, and beside it the mean over prompts of each prompt's mean. With
`--store`, the offline estimate runs the trainer's simulated acceptance on captured held-out samples (a block at
every anchor, no target forward), walked as greedy decoding walks each answer, with the same definition, and is
reported beside the online tau.

Writes OUT/report.json, OUT/report.md, OUT/acceptance_by_position.png, OUT/tau_histogram.png and
OUT/provenance.json. OUT is claimed for the run (provenance.OutputClaim): a folder another stage wrote, or one
another eval is writing, is refused up front; then it is marked incomplete until all of them are written, so that an
eval killed (SIGKILL, SIGTERM, Ctrl-C) leaves it marked and its rerun completes it (an eval refused with one line
leaves it as it was). While it runs, OUT/.engine-runs holds the engine runs (jobs and logs; their logs are copied to
OUT/engine at the end): an eval killed outright leaves nothing outside OUT, and no engine (engine.child stops with its
stage).

Prompts the drafter was trained on are refused (`check_held_out`): they would overstate tau. The drafter's
training_args.json names its training stores; their sample ids (or, where a store is not on this machine, the prompt
set it recorded) are compared with the prompts to evaluate. `--store` is re-hashed (store.verify.check_hashes, cached).

The stage's modules, in the order the data goes through them: config (EvalConfig, the flags), this one (the checks,
`evaluate` that runs the rest, the CLI), metrics (tau, acceptance by position, bootstrap intervals, the offline
estimate), vllm_sweep (the drafter in vLLM at each speculation length, with requests decoded together; its engine
runs through engine_runs, which keeps the prompts each refused), own_loop (the project's decoding loop and its
lossless check, on the prompts vLLM took: one it refused is left out of every comparison), report (report.json
through dflash_train.eval_report, report.md, the plots).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from dflash_train import constraints as request_constraints
from dflash_train.errors import UserError, writing
from dflash_train.eval_report import (ConstraintsSummary, DrafterRecord, EvalReport, HeldOutCheck, Machine,
                                      OfflineEstimate, Settings, is_report)
from dflash_train.options import add_options, from_args, validate
from dflash_train.provenance import (INCOMPLETE_MARKER, LOCK_FILE, OutputClaim, complete_output, read_json,
                                     start_output, write_provenance)
from dflash_train.spec_decode.loop import DFlashProposer
from dflash_train.stages.evaluate.config import EvalConfig
from dflash_train.report_tables import by_role
from dflash_train.stages.evaluate.metrics import offline_estimate
from dflash_train.stages.evaluate.own_loop import load_methods, own_loop_eval
from dflash_train.stages.evaluate.report import markdown, write_report
from dflash_train.stages.evaluate.vllm_sweep import engine_eval
from dflash_train.target import Features, Target, check_fits, load_target

STAGE = "eval"
ENGINE_RUNS = ".engine-runs"  # OUT's scratch folder of engine runs while the eval runs
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("the folder stays marked INCOMPLETE (an eval completes it only once every run has finished); rerun "
               "the same command to evaluate again")


# ------------------------------------------------------------------------------------------------ checks

def check_store_fits(manifest: dict[str, Any], config, target: Target, where: str) -> None:
    """A held-out store must hold what the drafter reads: this target's states of the drafter's layers."""
    reads = Features(target.identity(), tuple(config.target_layer_ids), config.hidden_size)
    check_fits(f"store {where}", Features.of_store(manifest), "what the drafter reads from this target", reads)


def check_held_out(drafter: str, ids: set[str], what: str, prompt_set: dict[str, Any] | None,
                   allow: bool = False) -> HeldOutCheck:
    """Refuse to evaluate a drafter on prompts it was trained on (they would overstate tau). Its training_args.json
    names its training stores: a store on this machine is compared by id (a sample's id is its prompt's id), one that
    is not by the prompt set it recorded (prompts.prompt_set: the same source and split). `ids` and `prompt_set` are
    those of `what` (the prompts, or the --store samples). Returns what was checked, for the report; with `allow`
    (--training-prompts) the overlap is counted there ("training_prompts") instead of refused."""
    from dflash_train.model.checkpoint import folder_file

    args_file = folder_file(Path(drafter), "training_args.json", str(Path(drafter) / "training_args.json"))
    if not args_file.exists():
        return HeldOutCheck(checked=False, why=f"{args_file} does not exist: the training data is unknown")
    stores = ((read_json(args_file, "the trainer's record of the run").get("data") or {}).get("stores") or [])
    by_id, by_prompt_set, not_checked, training_prompts = [], [], [], 0
    for entry in stores:
        path = Path(str(entry.get("path")))
        if (path / "manifest.json").exists():
            from dflash_train.store.reader import open_store

            trained = ids.intersection(open_store(path).ids)
            by_id.append(str(path))
            if trained and allow:
                training_prompts += len(trained)
            elif trained:
                raise UserError(f"{len(trained)} of the {len(ids)} {what} are in the training store {path} of drafter "
                                f"{drafter} (e.g. {', '.join(sorted(trained)[:3])}): tau on training prompts "
                                f"overstates the drafter. Evaluate on held-out prompts (--split eval of the ingest "
                                f"folder it was trained from)")
            continue
        held = entry.get("prompts")
        if isinstance(held, dict) and held.get("source") and prompt_set:
            by_prompt_set.append(str(path))
            same_split = None in (held.get("split"), prompt_set.get("split")) or held["split"] == prompt_set["split"]
            if held["source"] == prompt_set.get("source") and same_split and allow:
                training_prompts += len(ids)
            elif held["source"] == prompt_set.get("source") and same_split:
                raise UserError(f"drafter {drafter} was trained on store {path}, captured from {held['source']} split "
                                f"{held.get('split')!r}: the {what} are training prompts. Evaluate on held-out prompts "
                                f"(--split eval)")
        else:
            not_checked.append(str(path))
    return HeldOutCheck(checked=True, by_id=by_id, by_prompt_set=by_prompt_set, not_checked=not_checked,
                        training_prompts=training_prompts)


# ------------------------------------------------------------------------------------------------ the run

def evaluate(cfg: EvalConfig, workdir: Path | None = None) -> EvalReport:
    """Run the eval; `workdir` holds the engine runs (jobs and logs) when the engine takes part."""
    from dflash_train.device import default_device, machine, resolve_precision
    from dflash_train.prompts import check_records, load_prompt_records, prompt_set
    from dflash_train.target import vocab_size

    own, in_engine = check_options(cfg)
    records, _ = load_prompt_records(cfg.prompts, cfg.split, cfg.limit)
    check_records(records, vocab_size(cfg.target))

    held_out = {"prompts": check_held_out(cfg.drafter, {r.id for r in records},
                                          f"prompts to evaluate ({cfg.prompts}, split {cfg.split!r})",
                                          prompt_set(cfg.prompts, cfg.split, None), cfg.training_prompts)}
    device = cfg.device or default_device()
    where = machine(device)  # before anything runs: its load average says what else ran
    precision = resolve_precision(cfg.dtype, device)
    print(f"eval: compute dtype {precision.describe()}", flush=True)
    dtype_name, dtype = precision.name, precision.dtype
    target = load_target(cfg.target, dtype=dtype, device=device)
    methods = load_methods(cfg, target, dtype)
    mine = by_role(methods, "drafter")[0]
    main, B = mine.proposer, mine.block_size

    store, template_kwargs = None, cfg.template_kwargs
    if cfg.store:
        store, held_out["store"] = open_eval_store(cfg, target)
        if template_kwargs is None:
            template_kwargs = (store.manifest.get("generation") or {}).get("template_kwargs") or {}
    template_kwargs = template_kwargs or {}
    prompts, too_long = render_prompts(cfg, records, target, template_kwargs)
    constraints, constrained = eval_constraints([r for r in records if r.id in prompts], cfg, own)
    offline = offline_entry(cfg, store, main, target, B, prompts) if store is not None else None
    if in_engine and workdir is None:
        raise ValueError("evaluate(..., workdir) is needed when the engine takes part")
    vllm = engine_eval(cfg, target, prompts, B, dtype_name, device, Path(workdir), expected_tau(offline),
                       constraints) if in_engine else None
    refused = vllm.refused_by_engine if vllm else {}
    # after vLLM: a prompt it refused is left out of every comparison, the project's loop's too
    own_prompts = dict([(rid, ids) for rid, ids in prompts.items() if rid not in refused][:cfg.own_limit]
                       if own else [])
    own_loop = own_loop_eval(cfg, device, methods, target, own_prompts, dtype, constraints) if own else None
    settings = Settings(options=asdict(cfg), template_kwargs=template_kwargs, device=str(device), dtype=dtype_name,
                        dtype_reason=precision.reason, block_size=B, num_prompts=len(prompts),
                        own_prompts=len(own_prompts) if own else None, skipped_long_prompts=len(too_long),
                        constraints=constrained, threads=torch.get_num_threads(), machine=Machine(**where),
                        sampling=sampling_of(cfg))
    return EvalReport(block_size=B, settings=settings, drafter=_drafter_summary(cfg.drafter, main),
                      baseline_drafters=[_drafter_summary(m.drafter_path, m.proposer)
                                         for m in by_role(methods, "baseline")],
                      target=target.identity(), held_out_check=held_out, own=own_loop, vllm=vllm, offline=offline)


def check_options(cfg: EvalConfig) -> tuple[bool, bool]:
    """The flags, the drafters and the engine checked before anything is loaded; returns whether the project's loop
    and the engine take part."""
    from dflash_train.model.checkpoint import check_finished

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    validate(cfg)
    for path in [cfg.drafter, *cfg.baseline_drafters]:
        check_finished(path)
    own, in_engine = cfg.engine in ("own", "both"), cfg.engine in ("vllm", "both")
    vllm_only = [flag for flag, value in (("--engine-args", cfg.engine_args), ("--suffix", cfg.suffix),
                                          ("--combined", cfg.combined)) if value]
    if vllm_only and not in_engine:
        raise UserError(f"{vllm_only[0]} configures vLLM, and --engine {cfg.engine} does not run it: pass --engine "
                        f"vllm or both")
    if in_engine and len(cfg.baseline_drafters) > 1:
        raise UserError(f"--baseline-drafter: vLLM times one baseline drafter beside the drafter, and "
                        f"{len(cfg.baseline_drafters)} were given with --engine {cfg.engine}: pass one (the project's "
                        f"loop, --engine own, takes several)")
    if in_engine:
        from dflash_train.engine.install import check_vllm
        from dflash_train.spec_decode.suffix import suffix_problem

        check_vllm()  # before anything is loaded: a missing engine is one line, not a late failure
        if cfg.suffix and (problem := suffix_problem()):
            raise UserError(f"--suffix: {problem}")
    return own, in_engine


def render_prompts(cfg: EvalConfig, records: list, target: Target, template_kwargs: dict[str, Any]
                   ) -> tuple[dict[str, list[int]], list[str]]:
    """The prompts' token ids by id, rendered with the target's chat template, and the ids of those longer than
    --max-prompt-tokens (left out); none left is an error."""
    prompts = {r.id: target.render(r.messages, r.tools, **template_kwargs) for r in records}
    too_long = [rid for rid, ids in prompts.items() if cfg.max_prompt_tokens and len(ids) > cfg.max_prompt_tokens]
    for rid in too_long:
        del prompts[rid]
    if not prompts:
        raise UserError(f"all {len(too_long)} prompts of {cfg.prompts} (split {cfg.split!r}) are longer than "
                        f"--max-prompt-tokens {cfg.max_prompt_tokens}: nothing to evaluate")
    return prompts, too_long


def sampling_of(cfg: EvalConfig) -> str:
    """How the eval samples, in words (the report's settings.sampling)."""
    return ("greedy" if cfg.temperature == 0 else
            f"temperature {cfg.temperature}, Gumbel-max noise keyed on (seed, prompt id, position)")


def offline_entry(cfg: EvalConfig, store, main: DFlashProposer, target: Target, block_size: int,
                  prompts: dict[str, list[int]]) -> OfflineEstimate:
    """The offline estimate on the --store's samples (its first --limit), and how many of them are of the prompts
    evaluated online."""
    n = len(store) if cfg.limit is None else min(cfg.limit, len(store))
    offline = offline_estimate((store[i] for i in range(n)), main.drafter, target.model.get_input_embeddings().weight,
                               target.model.get_output_embeddings().weight, block_size)
    return replace(offline, store=str(cfg.store),
                   samples_of_eval_prompts=sum(r.id in prompts for r in offline.per_sample))


def expected_tau(offline: OfflineEstimate | None) -> tuple[str, list[float]] | None:
    """What the engine sweep starts from (vllm_sweep.sweep_first_k): the expected tau at each K by the offline
    estimate, else nothing (the project's loop decodes after the engine, the prompts it took)."""
    return ("offline estimate", offline.tau_by_k) if offline else None


LEFT_OUT = request_constraints.NOT_WITH_SPECULATION + ("seed", "n")  # what eval_constraints decodes without


def eval_constraints(records: list, cfg: EvalConfig, own: bool
                     ) -> tuple[dict[str, dict[str, Any] | None], ConstraintsSummary]:
    """Each prompt's constraints as the eval decodes it (plain and speculative alike), and what the report says of
    them: how many prompts were constrained, by kind, and how many were decoded without a setting vLLM refuses with
    speculative decoding (min_p, logit_bias: left out on both sides, never silently). The eval samples by its own
    --temperature and --seed, so a request's seed and n are not used."""
    by_id: dict[str, dict[str, Any] | None] = {}
    kinds: dict[str, int] = {}
    without = {key: 0 for key in request_constraints.NOT_WITH_SPECULATION}
    for r in records:
        for key in without:
            without[key] += key in (r.constraints or {})
        c = request_constraints.without(r.constraints, LEFT_OUT)
        if own:
            try:
                request_constraints.check_replayable(c, cfg.temperature == 0, f"prompt {r.id}")
            except ValueError as err:
                raise UserError(str(err)) from None
        by_id[r.id] = c
        kind = request_constraints.kind(c)
        kinds[kind] = kinds.get(kind, 0) + 1
    constrained = sum(n for kind, n in kinds.items() if kind != "none")
    return by_id, ConstraintsSummary(constrained=constrained, of=len(records), by_kind=kinds, decoded_without=without)


def open_eval_store(cfg: EvalConfig, target: Target):
    """The --store of the offline estimate, its shards re-hashed, checked to hold no training sample and to hold
    what the drafter reads from this target; returns (store, its held-out check for the report)."""
    from dflash_train.model.checkpoint import read_config
    from dflash_train.store.format import holds_states
    from dflash_train.store.reader import open_store
    from dflash_train.store.verify import check_hashes

    check_hashes(cfg.store)
    store = open_store(cfg.store)
    if not holds_states(store.manifest):
        raise UserError(f"--store {cfg.store} is a token-only store (captured with --storage none): the offline "
                        "estimate reads the target's hidden states; capture the held-out prompts with states")
    held_out = check_held_out(cfg.drafter, set(store.ids), f"samples of --store {cfg.store}",
                              store.manifest.get("prompts"), cfg.training_prompts)
    check_store_fits(store.manifest, read_config(cfg.drafter), target, cfg.store)
    return store, held_out


def _drafter_summary(path: str, proposer: DFlashProposer) -> DrafterRecord:
    """The drafter the report measured: its shape, and what decides its outputs (checkpoint.drafter_identity:
    sha256, weights_sha256 and config), which push holds the folder it releases against."""
    from dflash_train.model.checkpoint import drafter_identity, read_config

    cfg = read_config(path)
    return DrafterRecord(path=str(path), block_size=cfg.block_size, num_hidden_layers=cfg.num_hidden_layers,
                         target_layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
                         draft_vocab_size=cfg.draft_vocab_size,
                         num_parameters=sum(p.numel() for p in proposer.drafter.parameters()),
                         **drafter_identity(Path(path)), made_for_target=(cfg.target or {}).get("name"))


# ------------------------------------------------------------------------------------------------ CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, EvalConfig)


def is_eval_folder(folder: Path) -> bool:
    """An eval's output from before folders recorded their stage: its report.json holds a tau and the settings (a
    report.json alone may be anyone's); or what an eval killed before evals marked their folder left in one it had
    created: its engine runs."""
    if {p.name for p in folder.iterdir()} <= {ENGINE_RUNS, LOCK_FILE}:
        return True
    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return is_report(report)


def run(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    cfg = from_args(EvalConfig, args)
    out = Path(cfg.out)
    # claimed first: a folder that is not an eval's, or that another eval is writing, is refused before minutes of
    # decoding; a run that fails leaves no folder behind when it created it
    with OutputClaim(out, STAGE, legacy=is_eval_folder):
        # engine runs (jobs, logs) go to a scratch folder in OUT, removed when the eval ends, so that an eval killed
        # outright (SIGKILL, or SIGTERM) leaves nothing outside its folder, and its rerun removes what it left. Kept
        # only when the error's line names an engine log in it (engine.runner.run_engine's "full log: PATH"), for
        # the failure report: then moved to the temporary folder, the line naming it there
        workdir = out / ENGINE_RUNS
        shutil.rmtree(workdir, ignore_errors=True)  # a killed run's
        marked = (out / INCOMPLETE_MARKER).exists()  # by an eval killed before this one
        with writing(out):
            start_output(out, STAGE)  # until the report is written: an eval killed (or Ctrl-C) leaves it marked
            workdir.mkdir()
        report = None
        try:
            report = evaluate(cfg, workdir)  # all checks and decoding first: a bad input leaves no half-written folder
            with writing(out):
                write_report(report, out)
                if report.vllm:
                    logs = out / "engine"
                    logs.mkdir(exist_ok=True)
                    for log in sorted(workdir.glob("*/engine.log")):
                        shutil.copyfile(log, logs / f"{log.parent.name}.log")
                write_provenance(out, config=asdict(cfg), stage=STAGE, drafter=asdict(report.drafter),
                                 target=report.target.to_dict())
                complete_output(out)
        except UserError as err:
            if report is None and not marked:  # refused before any write: the folder as it was (one it made goes)
                (out / INCOMPLETE_MARKER).unlink()
            if str(workdir) in str(err):
                kept = Path(tempfile.mkdtemp(prefix="dflash-eval-engine-"))
                for run_dir in workdir.iterdir():
                    shutil.move(run_dir, kept / run_dir.name)
                raise UserError(str(err).replace(str(workdir), str(kept))) from None
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    print(markdown(report))
    print(f"eval report: {out / 'report.json'}, {out / 'report.md'}, {out / 'acceptance_by_position.png'}, "
          f"{out / 'tau_histogram.png'}")
    return 0
