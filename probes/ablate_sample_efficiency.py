"""`make ablate`: which training levers make the drafter learn faster, on the same data and the same wall clock.

    python probes/ablate_sample_efficiency.py [--time-budget 240] [--variant NAME:k=v,k=v ...] [--only a,b] [--quick]

Every variant is a list of recipe overrides applied to the same base recipe, after the public DFlash settings
(--base), and trains on the same store for the same wall-clock budget (train.time_budget_s), with a simulated-tau
eval every --eval-every steps on the same held-out store, so each run's metrics.jsonl has simulated tau against
time. Default variants: baseline (the public recipe), init, soft, dense, norm, optim, warmup, focus, batch (one
lever each) and combo (the chosen combination, the demo recipe's: init + optim + warmup + focus + batch; --combo
replaces it). The public recipe drafts the target's whole vocabulary, so every variant does (the demo recipe's draft
vocabulary is measured apart: BENCHMARKS.md, "What the drafter's LM head costs a step"; soft labels need the whole
head). --variant NAME:k=v,... adds a variant or replaces the default of that name; --only keeps the listed
ones, in that order (the first is eval's --drafter).
Then ONE online eval (the target generates) of every variant's drafter on the same held-out prompts.
Writes OUT/results.md, OUT/results.json and OUT/sim_tau_vs_time.png. Complete stages are skipped on a rerun.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_train.errors import UserError
from dflash_train.provenance import is_complete
from dflash_train.support import runs

PUBLIC = ("drafter.init=random,drafter.context_norm=false,objective.num_anchors=64,optimizer.schedule=cosine,"
          "optimizer.lr=6e-4,objective.soft_label_weight=0,objective.context_warmup_ratio=0,"
          "objective.decay_gamma=7,train.micro_batch_size=1,drafter.draft_vocab_size=null")
LEVERS = {
    "init": "drafter.init=target",
    "soft": "objective.soft_label_weight=0.5",
    "dense": "objective.num_anchors=512",
    "norm": "drafter.context_norm=true",
    "optim": "optimizer.schedule=wsd,optimizer.lr=2e-3",
    "warmup": "objective.context_warmup_ratio=0.4",
    # added after the first full run (BENCHMARKS.md, "Follow-up screen"): weight the early slots, and two sequences
    # of 32 anchors per step instead of one of 64 (the same drafted positions per step)
    "focus": "objective.decay_gamma=3",
    "batch": "train.micro_batch_size=2,objective.num_anchors=32",
}
OUT = "results/ablate_sample_efficiency"
QUICK = {"limit": 40, "max_new_tokens": 32, "time_budget": 20.0, "eval_every": 5, "eval_limit": 12,
         "eval_max_new_tokens": 16}
FULL = {"limit": 1200, "max_new_tokens": 128, "time_budget": 240.0, "eval_every": 25, "eval_limit": 40,
        "eval_max_new_tokens": 64}


CHOSEN = ",".join(LEVERS[name] for name in ("init", "optim", "warmup", "focus", "batch"))


def default_variants(combo: str | None) -> dict[str, list[str]]:
    variants = {"baseline": []}
    variants.update({name: runs.split_overrides(text) for name, text in LEVERS.items()})
    variants["combo"] = runs.split_overrides(combo if combo is not None else CHOSEN, "--combo")
    return variants


def select_variants(combo: str | None, extra: list[str], only: str | None) -> dict[str, list[str]]:
    """The default variants, with --variant entries added or replacing, then --only applied (its order kept)."""
    variants = default_variants(combo)
    for text in extra:
        name, overrides = runs.parse_variant(text)
        variants[name] = overrides
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in variants]
        if unknown:
            raise UserError(f"--only names unknown variant(s) {', '.join(unknown)} "
                            f"(known: {', '.join(variants)})")
        variants = {n: variants[n] for n in names}
    if not variants:
        raise UserError("no variants selected")
    return variants


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runs.add_common_arguments(p, "ablate", OUT)
    p.add_argument("--store", default=None, help="an existing training store (default: capture one)")
    p.add_argument("--store-topk", type=int, default=8, help="capture --store-topk K (soft labels); 0 = off")
    p.add_argument("--time-budget", type=float, default=None, help="training seconds per variant (default 240)")
    p.add_argument("--max-steps", type=int, default=None, help="a step cap on top of the time budget")
    p.add_argument("--eval-every", type=int, default=None, help="steps between simulated-tau evals (default 25)")
    p.add_argument("--base", default=PUBLIC, help=f"overrides every variant starts from (default: {PUBLIC})")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,K=V",
                   help="add a variant, or replace the default of that name; repeatable")
    p.add_argument("--combo", default=None,
                   help="the combo variant's overrides, k=v,k=v (default: init + optim + warmup + focus + batch)")
    p.add_argument("--only", default=None, help="run only these variants, comma-separated, in this order")
    return runs.fill_defaults(p.parse_args(argv), FULL, QUICK, "ablate", OUT)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = select_variants(args.combo, args.variant, args.only)
    base = runs.split_overrides(args.base, "--base")
    work = Path(args.workdir).resolve()
    prompts = work / args.prompts
    stores = work / "data" / "store"
    run_root = work / "runs" / args.name
    log = runs.Log()

    runs.ensure_prompts(prompts, log)
    if args.store:
        store = Path(args.store).resolve()
        if not is_complete(store):
            raise UserError(f"--store {store} is not a complete capture store")
    else:
        store = stores / f"{args.name}-train"
        topk = ["--store-topk", str(args.store_topk)] if args.store_topk > 0 else []
        runs.run_stage("capture (training prompts)", store, runs.capture_command(
            prompts, store, "train", args.limit, args.max_prompt_tokens, args.max_new_tokens, topk), log)
    heldout = stores / f"{args.name}-heldout"
    runs.run_stage("capture (held-out prompts)", heldout, runs.capture_command(
        prompts, heldout, "eval", args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens), log)

    common = [f"data.stores=[{store}]", f"data.eval_store={heldout}", *base,
              *runs.budget_overrides(args.max_steps, args.time_budget, args.eval_every)]
    plan = {name: (run_root / name, overrides) for name, overrides in variants.items()}
    runs.train_runs(args.recipe, plan, common, log)

    report_dir = run_root / "eval"
    runs.run_stage("eval (online, all variants)", report_dir, runs.eval_command(
        [run_dir / "drafter" for run_dir, _ in plan.values()], prompts, args.eval_limit, args.max_prompt_tokens,
        args.eval_max_new_tokens, heldout, report_dir), log)
    write_report(args, Path(args.out).resolve(), plan, base, report_dir, log)
    return 0


def write_report(args: argparse.Namespace, out: Path, plan: dict[str, tuple[Path, list[str]]], base: list[str],
                 report_dir: Path, log: runs.Log) -> None:
    report = runs.read_report(report_dir)
    rows = runs.run_rows(plan, report)
    table = [[name, ", ".join(r["overrides"]) or "(base)", r["steps"], round(r["train_s"]), r["final_sim_tau"],
              r["online_tau"], r["acceptance_first"], r["tokens_per_s"], r["tokens_per_s_ratio"],
              r["lossless_mismatches"]]
             for name, r in rows.items()]
    curves = {name: runs.eval_curve(run_dir / "metrics.jsonl", runs.TRAIN_TIME) for name, (run_dir, _) in plan.items()}
    png = runs.plot_curves(curves, "training time (s, evals excluded)", "simulated tau (held-out store)",
                           f"Sample efficiency: {args.time_budget:.0f} s per variant", out / "sim_tau_vs_time.png")
    md = "\n\n".join([
        runs.header("Ablation: sample efficiency on a fixed wall-clock budget", "probes/ablate_sample_efficiency.py"),
        f"Base recipe {args.recipe} with `{', '.join(base) or '(nothing)'}`, then each variant's overrides. Budget: "
        f"{args.time_budget:.0f} s of training per variant (train.time_budget_s), simulated tau every "
        f"{args.eval_every} steps on the same held-out store. "
        + runs.eval_description(report, args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens),
        runs.markdown_table(["variant", "overrides", "steps in budget", "training s", "final simulated tau",
                             "online tau", "acceptance pos 1/2/3", "tokens/s", "tokens/s vs plain",
                             "lossless mismatches"], table),
        "![simulated tau vs time](sim_tau_vs_time.png)",
        runs.commands_section(log)]) + "\n"
    runs.write_results(out, md, {"base": base, "variants": rows, "curves": curves, "eval_report": str(report_dir)},
                       [png], log, work=Path(args.workdir))


if __name__ == "__main__":
    runs.script_main(main)
