"""`make demo`: the whole pipeline on the embedded target, as a user runs it, one stage after another.

    python scripts/demo.py                 # ingest -> capture -> train -> eval -> push --dry-run

Each stage runs as its own command (exactly what README shows), so the demo cannot pass while a stage's
command is broken. A stage whose output folder is complete and valid is skipped, and the demo says so; a stage
that fails stops the demo with that stage's own error. At the end it prints the eval table, the wall time of
each stage, and where every artefact is.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_train.provenance import is_complete  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=".", help="where data/, runs/, eval/ and push/ go (default: repo root)")
    p.add_argument("--name", default="smollm2-demo", help="names the store, run, eval and push folders")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--logs", nargs="*", default=[], help="production logs to ingest (default: the ShareGPT package)")
    p.add_argument("--prompts-name", default="sharegpt")
    p.add_argument("--capture-limit", type=int, default=1200, help="training prompts read for capture")
    p.add_argument("--store-topk", type=int, default=8,
                   help="capture --store-topk K: the target's top-K log-probs per token (the recipe's soft labels)")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="longer prompts are skipped at capture and eval (keeps the CPU demo short)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response cap at capture and eval")
    p.add_argument("--batch-size", type=int, default=16, help="capture batch size")
    p.add_argument("--recipe", default="recipes/smollm2-135m-demo.yaml")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, repeatable (e.g. train.max_steps=5)")
    p.add_argument("--eval-limit", type=int, default=40, help="held-out prompts read for eval")
    p.add_argument("--repo", default="your-org/smollm2-135m-instruct-dflash", help="Hub repo named in the card")
    return p.parse_args(argv)


def run_stage(name: str, command: list[str], timings: dict[str, float]) -> None:
    print(f"\n=== {name}: {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO)
    timings[name] = time.perf_counter() - start
    if result.returncode != 0:
        print(f"\ndemo stopped: stage {name!r} failed (exit {result.returncode}); its error is above. "
              f"Fix it and rerun: finished stages are skipped.", file=sys.stderr)
        raise SystemExit(result.returncode)


def skip(name: str, folder: Path, timings: dict[str, float]) -> None:
    print(f"\n=== {name}: {folder} is complete and valid, skipping (delete it to redo this stage)", flush=True)
    timings[name] = 0.0


def store_is_valid(store: Path) -> bool:
    if not is_complete(store):
        return False
    check = subprocess.run([sys.executable, "-m", "dflash_train", "verify", str(store)], cwd=REPO,
                           capture_output=True, text=True)
    return check.returncode == 0


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
    py = sys.executable
    length_args = ["--max-prompt-tokens", str(args.max_prompt_tokens), "--max-new-tokens", str(args.max_new_tokens)]
    timings: dict[str, float] = {}
    total = time.perf_counter()

    if is_complete(prompts):
        skip("ingest", prompts, timings)
    else:
        run_stage("ingest", [py, "-m", "dflash_train", "ingest", *args.logs, "--out", str(prompts),
                             "--target", args.target], timings)

    if store_is_valid(store):
        skip("capture", store, timings)
    else:
        run_stage("capture", [py, "-m", "dflash_train", "capture", "--prompts", str(prompts), "--split", "train",
                              "--target", args.target, "--out", str(store), "--limit", str(args.capture_limit),
                              *length_args, "--batch-size", str(args.batch_size),
                              "--store-topk", str(args.store_topk)], timings)

    if is_complete(drafter):
        skip("train", drafter, timings)
    else:
        overrides = [f"name={args.name}", f"output_dir={run}", f"data.stores=[{store}]", *args.train_override]
        run_stage("train", [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                            "--mixed_precision", "no", "--dynamo_backend", "no", "train.py", args.recipe,
                            *overrides], timings)

    # the held-out prompts' own capture: the store the offline (simulated) tau is computed on
    eval_args = ["--split", "eval", "--limit", str(args.eval_limit), *length_args]
    if store_is_valid(eval_store):
        skip("capture (held-out)", eval_store, timings)
    else:
        run_stage("capture (held-out)", [py, "-m", "dflash_train", "capture", "--prompts", str(prompts),
                                         "--target", args.target, "--out", str(eval_store), *eval_args,
                                         "--batch-size", str(args.batch_size)], timings)

    if is_complete(report):
        skip("eval", report, timings)
    else:
        run_stage("eval", [py, "-m", "dflash_train", "eval", "--drafter", str(drafter), "--target", args.target,
                           "--prompts", str(prompts), *eval_args, "--store", str(eval_store), "--out", str(report)],
                  timings)

    run_stage("push (dry run)", [py, "-m", "dflash_train", "push", str(drafter), "--repo", args.repo,
                                 "--eval-report", str(report), "--out", str(push), "--dry-run"], timings)

    wall = time.perf_counter() - total
    print("\n" + "=" * 80)
    print((report / "report.md").read_text())
    headline = json.loads((report / "report.json").read_text())
    print(f"online tau {headline['tau']:.2f} | offline tau {headline.get('tau_offline')} | "
          f"lossless mismatches {headline['lossless_mismatches']} | speedup {headline['speedup']:.2f}x")
    print("\nstage wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f" | total {wall:.0f} s")
    print("artefacts:")
    for label, path in [("prompts", prompts), ("capture store", store), ("held-out store", eval_store),
                        ("training run", run),
                        ("drafter", drafter), ("eval report", report), ("push folder (dry run)", push)]:
        print(f"  {label:<22} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
