"""`make experiment`: does training on the target's own outputs beat training on the logged responses?

    python scripts/experiment_own_outputs.py [--steps 400 | --time-budget 600] [--sizes 32,96,all] [--quick]

Same prompts, same drafter size, same training budget, three drafters:
  own     the store captured with the target's own responses (`capture --responses generate`)
  logged  the store captured with the logged ShareGPT responses over the same prompts (`--responses logged`)
  adapt   `logged`'s final drafter fine-tuned on the first --adapt-fraction of `own`'s samples for
          --adapt-steps-fraction of the budget (recipe key drafter.init_from)
plus the data-size curve: `own` trained on only the first N samples (recipe key data.max_samples) for each N in
--sizes at the same budget ('all' is `own` itself). Every run's simulated tau is measured during training on the
same held-out store (the eval split, the target's own responses: what serving sees). Then ONE online eval (the
target generates, real speculative decoding) of every drafter on the same held-out prompts. Writes OUT/results.md,
OUT/results.json, OUT/sim_tau_vs_step.png and OUT/tau_vs_samples.png. Stages whose output folder is complete are
skipped on a rerun; the heavy outputs (stores, runs, the eval folder) go under WORKDIR/data/store and WORKDIR/runs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from dflash_train.errors import CommandParser, UserError
from dflash_train.support import runs

OUT = "results/experiment_own_outputs"
QUICK = {"limit": 40, "steps": 6, "eval_every": 3, "eval_limit": 12, "eval_max_new_tokens": 16,
         "max_new_tokens": 32, "sizes": "4,all"}
FULL = {"limit": 600, "steps": 400, "eval_every": 50, "eval_limit": 40, "eval_max_new_tokens": 128,
        "max_new_tokens": 128, "sizes": "32,96,all"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runs.add_common_arguments(p, "exp", OUT)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 400)")
    budget.add_argument("--time-budget", type=float, default=None,
                        help="seconds of training per run (train.time_budget_s) instead of a step count")
    p.add_argument("--eval-every", type=int, default=None, help="steps between simulated-tau evals (default 50)")
    p.add_argument("--adapt-fraction", type=float, default=0.2, help="share of own's samples the adapt run sees")
    p.add_argument("--adapt-steps-fraction", type=float, default=0.25, help="share of the budget the adapt run gets")
    p.add_argument("--adapt-override", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for the adapt run only, repeatable (e.g. optimizer.lr=2e-4)")
    p.add_argument("--sizes", default=None, help="data-size curve: sample counts, 'all' = every sample "
                                                 "(default 32,96,all)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for every run, repeatable")
    p.add_argument("--own-store", default=None,
                   help="an existing store of the target's own responses to use as (a) instead of capturing one; "
                        "it must have been captured with this run's --limit, --max-prompt-tokens, --max-new-tokens")
    args = p.parse_args(argv)
    timed = {"steps": None} if args.time_budget is not None else {}  # a time budget: no step count
    runs.fill_defaults(p, args, {**FULL, **timed}, {**QUICK, **timed}, "exp", OUT)
    if not 0 < args.adapt_fraction <= 1 or not 0 < args.adapt_steps_fraction <= 1:
        p.error("--adapt-fraction and --adapt-steps-fraction must be in (0, 1]")
    return args


def scaled_budget(args: argparse.Namespace, fraction: float) -> list[str]:
    steps = max(1, math.ceil(args.steps * fraction)) if args.steps else None
    budget = args.time_budget * fraction if args.time_budget is not None else None
    return runs.budget_overrides(steps, budget, max(1, min(args.eval_every, steps or args.eval_every)))


def compare_ids(own: list[str], logged: list[str]) -> dict[str, Any]:
    both = set(own) & set(logged)
    return {"own": len(own), "logged": len(logged), "common": len(both), "only_own": len(set(own) - both),
            "only_logged": len(set(logged) - both), "same_order": [i for i in own if i in both] ==
            [i for i in logged if i in both]}


def check_own_store(store: Path, args: argparse.Namespace) -> None:
    """--own-store must hold the target's own responses to the prompts the logged capture will read."""
    from dflash_train.store.reader import open_store

    capture = open_store(store).manifest.get("capture") or {}
    wanted = {"responses": "generate", "split": "train", "limit": args.limit,
              "max_prompt_tokens": args.max_prompt_tokens, "max_new_tokens": args.max_new_tokens}
    wrong = {k: capture.get(k) for k, v in wanted.items() if capture.get(k) != v}
    if wrong:
        raise UserError(f"--own-store {store} was captured with {wrong}, this run needs "
                        f"{ {k: wanted[k] for k in wrong} }: pass matching options or let the script capture")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    prompts = work / args.prompts
    stores = work / "data" / "store"
    run_root = work / "runs" / args.name
    out = Path(args.out).resolve()
    log = runs.Log()
    lengths = (args.max_prompt_tokens, args.max_new_tokens)

    runs.ensure_prompts(prompts, log)
    own_store, logged_store, heldout = (stores / f"{args.name}-own", stores / f"{args.name}-logged",
                                        stores / f"{args.name}-heldout")
    captures = [("own", own_store, "generate"), ("logged", logged_store, "logged")]
    if args.own_store:
        own_store = Path(args.own_store).resolve()
        check_own_store(own_store, args)
        log.add("capture (own responses): given with --own-store", [str(own_store)], None, skipped=True)
        captures = captures[1:]
    for label, store, responses in captures:
        runs.run_stage(f"capture ({label} responses)", store, runs.capture_command(
            prompts, store, "train", args.limit, *lengths, ["--responses", responses]), log)
    runs.run_stage("capture (held-out prompts, own responses)", heldout, runs.capture_command(
        prompts, heldout, "eval", args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens), log)
    ids = compare_ids(runs.store_ids(own_store), runs.store_ids(logged_store))
    print(f"\nsample ids: {ids}", flush=True)

    common = [*args.override, f"data.eval_store={heldout}"]
    full = scaled_budget(args, 1.0)
    plan: dict[str, tuple[Path, list[str]]] = {
        "own": (run_root / "own", [f"data.stores=[{own_store}]", *full]),
        "logged": (run_root / "logged", [f"data.stores=[{logged_store}]", *full]),
    }
    adapt_n = max(1, math.ceil(args.adapt_fraction * ids["own"]))
    plan["adapt"] = (run_root / "adapt", [f"data.stores=[{own_store}]", f"data.max_samples={adapt_n}",
                                          f"drafter.init_from={run_root / 'logged' / 'drafter'}",
                                          *scaled_budget(args, args.adapt_steps_fraction), *args.adapt_override])
    sizes = {}
    for n in runs.parse_sizes(args.sizes):
        if n is None or n >= ids["own"]:
            sizes[ids["own"]] = "own"
        else:
            sizes[n] = f"own-n{n}"
            plan[f"own-n{n}"] = (run_root / f"own-n{n}", [f"data.stores=[{own_store}]", f"data.max_samples={n}", *full])
    runs.train_runs(args.recipe, plan, common, log)

    report_dir = run_root / "eval"
    drafters = [run_dir / "drafter" for run_dir, _ in plan.values()]
    runs.run_stage("eval (online, all drafters)", report_dir, runs.eval_command(
        drafters, prompts, args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens, heldout, report_dir),
        log)
    write_report(args, out, plan, sizes, ids, adapt_n, report_dir, log)
    return 0


def write_report(args: argparse.Namespace, out: Path, plan: dict[str, tuple[Path, list[str]]], sizes: dict[int, str],
                 ids: dict[str, Any], adapt_n: int, report_dir: Path, log: runs.Log) -> None:
    report = runs.read_report(report_dir)
    rows = runs.run_rows(plan, report)
    descriptions = {"own": "target's own responses", "logged": "logged ShareGPT responses",
                    "adapt": f"logged, then fine-tuned on the first {adapt_n} own samples"}
    main_rows = [[label, descriptions[label], r["steps"], r["final_sim_tau"], r["online_tau"], r["acceptance_first"],
                  r["tokens_per_s"], r["tokens_per_s_ratio"], r["lossless_mismatches"]]
                 for label, r in rows.items() if label in descriptions]
    size_rows = [[n, label, rows[label]["steps"], rows[label]["final_sim_tau"], rows[label]["online_tau"],
                  rows[label]["tokens_per_s_ratio"]] for n, label in sorted(sizes.items())]
    curves = {label: runs.eval_curve(run_dir / "metrics.jsonl", "step") for label, (run_dir, _) in plan.items()}
    # adapt continues from logged's final drafter: plot it after logged's steps
    curves["adapt"] = [(rows["logged"]["steps"] + x, y) for x, y in curves["adapt"]]
    pngs = [runs.plot_curves(curves, "training step (adapt: after logged's)", "simulated tau (held-out store)",
                             "Simulated acceptance length during training", out / "sim_tau_vs_step.png"),
            runs.plot_curves({"online tau": [(n, rows[label]["online_tau"]) for n, label in sorted(sizes.items())],
                              "simulated tau (end of training)": [(n, rows[label]["final_sim_tau"])
                                                                  for n, label in sorted(sizes.items())]},
                             "training samples (own responses)", "acceptance length (tau)",
                             "Data-size curve at a fixed budget", out / "tau_vs_samples.png")]
    md = "\n\n".join([
        runs.header("Experiment: training on the target's own outputs vs the logged responses",
                    "scripts/experiment_own_outputs.py"),
        f"Training stores: {ids['own']} samples with the target's own responses, {ids['logged']} with the logged "
        f"responses; {ids['common']} sample ids in common ({ids['only_own']} only in own, {ids['only_logged']} only "
        f"in logged; same order: {ids['same_order']}). Budget per run: "
        f"{f'{args.steps} steps' if args.time_budget is None else f'{args.time_budget:.0f} s of training'} "
        f"(adapt: {args.adapt_steps_fraction:.0%} of it on top of logged's). Simulated tau: every run measured on "
        f"the same held-out store. "
        + runs.eval_description(report, args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens),
        "## Own outputs vs logged responses\n\n" + runs.markdown_table(
            ["drafter", "training data", "steps", "simulated tau", "online tau", "acceptance pos 1/2/3",
             "tokens/s", "tokens/s vs plain", "lossless mismatches"], main_rows),
        "![simulated tau vs step](sim_tau_vs_step.png)",
        "## Data-size curve (own responses, same budget)\n\n" + runs.markdown_table(
            ["samples", "run", "steps", "simulated tau", "online tau", "tokens/s vs plain"], size_rows),
        "![tau vs samples](tau_vs_samples.png)",
        runs.commands_section(log)]) + "\n"
    runs.write_results(out, md, {"ids": ids, "runs": rows, "sizes": {str(n): label for n, label in sizes.items()},
                                 "curves": curves, "eval_report": str(report_dir)}, pngs, log,
                       work=Path(args.workdir))


if __name__ == "__main__":
    runs.script_main(main)
