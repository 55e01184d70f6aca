"""Serving benchmark: the speculation length K and the concurrency, in vLLM and in the project's loop, every speedup
beside a stopwatch.

    python benchmarks/bench_serving.py DRAFTER [--prompts data/prompts/sharegpt] [--limit 40] [--max-prompt-tokens 384]
        [--max-new-tokens 128] [--speculative-tokens 1,2,3,5,7,15] [--concurrency 4,16] [--sweep-budget-s 3600]
        [--ngram 15] [--stopwatch-rounds 4] [--out results/bench_serving]

One command, three measurements of the same held-out prompts, printed side by side (OUT/bench.md, OUT/bench.json):

1. the eval stage itself, `dflash-train eval --engine vllm` (--eval-out): vLLM's K table at batch 1 (tau, tokens/s
   and speedup with bootstrap intervals, by the engine core and by a stopwatch around each request), the
   concurrency table and best_k (with --ngram K,..., vLLM's prompt lookup at those K beside it: the baseline);
2. the project's loop (spec_decode.loop) at the same K (a verify block of K + 1) on the same prompts at the same fixed
   lengths, plain and speculative alternating, by its own decode clock and by a stopwatch around each generation
   (without the requests' constraints: on constrained traffic it times other answers than the eval's);
3. an independent stopwatch: fresh vLLM engines with the eval's arguments, each in a fresh process, each prompt under
   its request's constraints as the eval decodes it (structured outputs, penalties, ...), plain alone then
   speculative at best_k alone (then prompt lookup at its fastest K alone, with --ngram), four times, every other
   time in the reverse order, every prompt at the same fixed length (ignore_eos), a plain perf_counter around each
   request.
   The eval's speedup at best_k (and prompt lookup's) is believed when this agrees (within 5%).

The eval's folder is reused when it is complete (delete it to measure again). `uptime` is recorded before and after
each part: other jobs on the machine slow everything, and the tables say how loaded it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash_train.engine.jobs import EngineRequest
from dflash_train.errors import CommandParser
from dflash_train.eval_report import EvalReport, KRow, VllmEval, fields_of
from dflash_train.options import at_least, int_list
from dflash_train.support import runs

AGREEMENT = 0.05  # the eval's speedup and the independent stopwatch's may differ by this much


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="a drafter folder (runs/NAME/drafter)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompts", default="data/prompts/sharegpt", help="an ingest folder; its eval split is used")
    p.add_argument("--limit", type=int, default=40, help="held-out prompts read (those under --max-prompt-tokens run)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--speculative-tokens", default=None, help="K to measure, e.g. 1,2,3,5,7,15 (default: the "
                                                               "eval's order, as far as --sweep-budget-s goes)")
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--sweep-budget-s", type=float, default=3600.0)
    p.add_argument("--repeats", type=int, default=1, help="the eval's timed runs per prompt and side")
    p.add_argument("--ngram", default=None, help="the K at which the eval also times vLLM's prompt lookup, e.g. 4 "
                                                 "or 2,3,4 (its fastest is stopwatched)")
    p.add_argument("--stopwatch-rounds", type=int, default=4,  # 2 missed by 6-11% on a host drifting 20%
                   help="rounds of fresh engines, plain then speculative (then prompt lookup)")
    p.add_argument("--own-k", default=None, help="the K to time in the project's loop, e.g. 1,3,15 (default: every K "
                                                 "the eval measured; '' skips the project's loop)")
    p.add_argument("--out", default="results/bench_serving", help="bench.md and bench.json")
    p.add_argument("--eval-out", default="eval/bench_serving", help="the eval's folder (reused when complete)")
    p.add_argument("--stopwatch-child", help=argparse.SUPPRESS)  # internal: the independent stopwatch's process
    args = p.parse_args(argv)
    if args.own_k:  # the rest is checked by the eval it runs first; --own-k is read after it
        try:
            int_list(args.own_k)
        except argparse.ArgumentTypeError as err:
            p.error(f"--own-k: {err}")
    runs.check_options(p, args, {"--stopwatch-rounds": at_least(1)})
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file, not a folder")
    return args


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------------------------------ 1. the eval

def run_eval(args: argparse.Namespace, out: Path, log: list[dict[str, Any]]) -> dict[str, Any]:
    extra = ["--concurrency", args.concurrency, "--sweep-budget-s", str(args.sweep_budget_s), "--repeats",
             str(args.repeats), "--target", args.target]
    if args.speculative_tokens:
        extra += ["--speculative-tokens", args.speculative_tokens]
    if args.ngram:
        extra += ["--ngram", args.ngram]
    command = runs.eval_command([Path(args.drafter)], Path(args.prompts), args.limit, args.max_prompt_tokens,
                                args.max_new_tokens, None, out, engine="vllm", extra=extra)
    entry = {"part": "eval (vLLM)", "command": shlex.join(command), "uptime_before": uptime()}
    from dflash_train.provenance import PROVENANCE_FILE, is_complete

    if is_complete(out):
        made_by = json.loads((out / PROVENANCE_FILE).read_text()).get("command")
        entry["reused"] = True
        entry["command"] = ("dflash-train " + shlex.join(made_by[1:])) if made_by else "(not recorded)"  # what ran
        print(f"bench: reusing the complete eval in {out}", flush=True)
    else:
        print(f"bench: {entry['command']}", flush=True)
        started = time.perf_counter()
        if code := subprocess.run(command).returncode:  # the eval printed why; its exit code goes on (2: bad input)
            print(f"bench: the eval failed (command above); its folder: {out}", file=sys.stderr, flush=True)
            raise SystemExit(code)
        entry["seconds"] = time.perf_counter() - started
    entry["uptime_after"] = uptime()
    log.append(entry)
    return runs.read_report(out / "report.json", own=False)


def held_out_prompts(args: argparse.Namespace, report: EvalReport, target) -> list[EngineRequest]:
    """The prompts the eval timed as its timed runs decoded them: rendered as the eval renders them, each under its
    request's own constraints (less what the eval leaves out), at the length plain decoding found
    (`engine.jobs.at_length`)."""
    from dflash_train import constraints as request_constraints
    from dflash_train.engine.jobs import at_length
    from dflash_train.prompts import load_prompt_records
    from dflash_train.stages.evaluate.command import LEFT_OUT

    lengths = {p.id: p.new_tokens for p in report.vllm.per_prompt}
    records, _ = load_prompt_records(args.prompts, "eval", args.limit)
    kwargs = report.settings.template_kwargs
    return [at_length(EngineRequest(id=r.id, prompt_token_ids=target.render(r.messages, r.tools, **kwargs),
                                    max_tokens=lengths[r.id],
                                    constraints=request_constraints.without(r.constraints, LEFT_OUT)), lengths[r.id])
            for r in records if r.id in lengths]


# ------------------------------------------------------------------------------------------------ 2. own loop

def own_loop(args: argparse.Namespace, report: EvalReport, log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The project's loop at every K the eval measured: plain and speculative alternating, prompt by prompt, at
    the eval's fixed lengths (no stop token), by the loop's decode clock and by a stopwatch around each call."""
    import torch

    from dflash_train.stages.evaluate.metrics import acceptance_stats, bootstrap_interval, ratio_of_sums
    from dflash_train.stages.evaluate.own_loop import _load_proposer
    from dflash_train.spec_decode.loop import mean_tau, plain_generate, speculative_generate
    from dflash_train.target import load_target

    entry = {"part": "the project's loop", "uptime_before": uptime()}
    started = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[report.settings.dtype]
    target = load_target(args.target, dtype=dtype)
    prompts = held_out_prompts(args, report, target)
    rows = []
    measured = sorted(r.k for r in report.vllm.sweep)
    for k in measured if args.own_k is None else [int(k) for k in args.own_k.split(",")]:
        proposer = _load_proposer(args.drafter, target, k + 1, dtype)
        timed: dict[str, list[float]] = {"plain_s": [], "spec_s": [], "plain_wall_s": [], "spec_wall_s": []}
        steps, tokens, same = [], [], 0
        plain_generate(target.model, prompts[0].prompt_token_ids, 8, [])  # warm-up, both sides
        speculative_generate(target.model, prompts[0].prompt_token_ids, proposer, 8, [])
        for i, (ids, length) in enumerate((r.prompt_token_ids, r.max_tokens) for r in prompts):
            got = {}
            for side in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                t0 = time.perf_counter()
                got[side] = plain_generate(target.model, ids, length, []) if side == "plain" else \
                    speculative_generate(target.model, ids, proposer, length, [])
                timed[f"{side}_wall_s"].append(time.perf_counter() - t0)
                timed[f"{side}_s"].append(got[side].decode_s)
            steps.append(got["spec"].steps)
            tokens.append(length)
            same += got["spec"].tokens == got["plain"].tokens
        decoded = [t - 1 for t in tokens]
        n = len(prompts)
        every = list(range(n))
        row = {"k": k, **fields_of(acceptance_stats(steps, k + 1)),
               "tokens_per_s_baseline": ratio_of_sums(decoded, timed["plain_s"])(every),
               "tokens_per_s": ratio_of_sums(decoded, timed["spec_s"])(every),
               "speedup": ratio_of_sums(timed["plain_s"], timed["spec_s"])(every),
               "speedup_interval": bootstrap_interval(ratio_of_sums(timed["plain_s"], timed["spec_s"]), n),
               "speedup_wall": ratio_of_sums(timed["plain_wall_s"], timed["spec_wall_s"])(every),
               "speedup_wall_interval": bootstrap_interval(ratio_of_sums(timed["plain_wall_s"],
                                                                         timed["spec_wall_s"]), n),
               "per_prompt_tau": [mean_tau(s) for s in steps], "lossless_mismatches": n - same, "prompts": n}
        print(f"bench: project's loop K={k}: tau {row['tau_steps']:.3f}, speedup {row['speedup']:.3f} "
              f"(stopwatch {row['speedup_wall']:.3f})", flush=True)
        rows.append(row)
    entry.update(seconds=time.perf_counter() - started, uptime_after=uptime())
    log.append(entry)
    return rows


# ------------------------------------------------------------------------------------------------ 3. stopwatch

def stopwatch(args: argparse.Namespace, report: EvalReport, out: Path, log: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """The independent stopwatch: fresh engines, one at a time, each in a process of its own (vLLM's CPU
    environment is set before vLLM is imported; vLLM 0.32 on CPU cannot start another engine in a process after a
    prompt-lookup one): plain, then speculative (then prompt lookup), `rounds` times, every other round in the
    reverse order. Its job (the prompts' token ids), log and timings go to `out` (beside the eval: never to
    results/)."""
    from dflash_train.engine.install import engine_environment
    from dflash_train.target import load_target

    v = report.vllm
    target = load_target(args.target)
    sides = {"plain": v.engine_args_plain, "spec": v.engine_args}
    if v.ngram:  # prompt lookup: plain decoding's arguments with the eval's ngram speculative config
        sides["lookup"] = {**v.engine_args_plain, "speculative_config": v.ngram.engine_args}
    requests = held_out_prompts(args, report, target)
    out.mkdir(parents=True, exist_ok=True)
    entry = {"part": f"independent stopwatch (vLLM, K = {v.best_k}"
                     + (f"; prompt lookup, K = {v.ngram.k})" if "lookup" in sides else ")"),
             "uptime_before": uptime()}
    started = time.perf_counter()
    times: dict[str, list[list[float]]] = {side: [] for side in sides}
    job_file, env = out / "stopwatch-job.json", {**os.environ, **engine_environment("cpu")}
    with open(out / "stopwatch.log", "w") as f:
        for r in range(args.stopwatch_rounds):
            for side in list(sides)[::1 if r % 2 == 0 else -1]:
                job_file.write_text(json.dumps({"engine_args": sides[side], "stop_token_ids": target.stop_token_ids(),
                                                "requests": [asdict(r) for r in requests]}))
                proc = subprocess.run([sys.executable, __file__, args.drafter, "--stopwatch-child", str(job_file)],
                                      env=env, stdout=f, stderr=subprocess.STDOUT)
                if proc.returncode != 0:
                    raise SystemExit(f"bench: the stopwatch's {side} engine failed; its log: {out / 'stopwatch.log'}")
                times[side].append(json.loads((out / "stopwatch-result.json").read_text()))
                print(f"bench: stopwatch round {r + 1}, {side}: {sum(times[side][-1]):.1f} s", flush=True)
    entry.update(seconds=time.perf_counter() - started, uptime_after=uptime())
    log.append(entry)
    tokens = sum(r.max_tokens for r in requests)
    plain = sum(map(sum, times["plain"]))

    def against_plain(side: str) -> dict[str, Any]:
        spec = sum(map(sum, times[side]))
        return {"speedup": plain / spec, "tokens_per_s": tokens * len(times[side]) / spec,
                "speedup_by_round": [sum(p) / sum(s) for p, s in zip(times["plain"], times[side])]}
    return {"k": v.best_k, **against_plain("spec"), "tokens_per_s_baseline": tokens * len(times["plain"]) / plain,
            "lookup": ({"k": v.ngram.k, **against_plain("lookup")} if "lookup" in sides else None),
            "times": times}


def stopwatch_child(job_file: Path) -> None:
    """One fresh engine, warmed up, each prompt timed alone with a perf_counter around `generate` at its fixed
    length, under its request's constraints as the eval decodes it (`engine.child.vllm_sampling_params`), its
    prefix cache emptied first; the seconds go to stopwatch-result.json beside the job."""
    from dataclasses import replace

    from vllm import LLM

    from dflash_train.engine.child import vllm_sampling_params

    job = json.loads(job_file.read_text())
    requests, stops = [EngineRequest(**r) for r in job["requests"]], job["stop_token_ids"]
    llm = LLM(**job["engine_args"])
    warm = replace(requests[0], max_tokens=min(8, requests[0].max_tokens))
    llm.generate([{"prompt_token_ids": warm.prompt_token_ids}], vllm_sampling_params(warm, stops), use_tqdm=False)
    seconds = []
    for r in requests:
        params = vllm_sampling_params(r, stops)
        llm.reset_prefix_cache()  # every prompt prefilled in full, as in the eval (the warm-up cached the first)
        t0 = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": r.prompt_token_ids}], params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        assert len(got[0].outputs[0].token_ids) == r.max_tokens, (len(got[0].outputs[0].token_ids), r.max_tokens)
    (job_file.parent / "stopwatch-result.json").write_text(json.dumps(seconds))


# ------------------------------------------------------------------------------------------------ the tables

def tables(report: EvalReport, own: list[dict[str, Any]], watch: dict[str, Any]) -> str:
    from dflash_train.report_tables import concurrency_table, describe_machine, fmt, table, with_interval

    v = report.vllm
    mine = {r["k"]: r for r in own}
    rows = []
    for r in sorted(v.sweep, key=lambda r: r.k):
        o = mine.get(r.k, {})
        rows.append((f"**{r.k}**" if r.k == v.best_k else str(r.k),
                     with_interval(r.tau_steps, r.tau_steps_interval),
                     f"{fmt(r.tokens_per_s_baseline)} / {fmt(r.tokens_per_s)}",
                     with_interval(r.speedup, r.speedup_interval) + "×",
                     with_interval(r.speedup_wall, r.speedup_wall_interval) + "×",
                     f"{fmt(watch['speedup'])}×" if r.k == watch["k"] else "",
                     fmt(o.get("tau_steps")), f"{fmt(o.get('tokens_per_s_baseline'))} / {fmt(o.get('tokens_per_s'))}"
                     if o else "", with_interval(o.get("speedup"), o.get("speedup_interval")) + "×" if o else "",
                     with_interval(o.get("speedup_wall"), o.get("speedup_wall_interval")) + "×" if o else ""))
    if r := v.ngram:  # vLLM's prompt lookup (eval --ngram): the baseline, in vLLM only
        rows.append((f"{r.k}, prompt lookup", with_interval(r.tau_steps, r.tau_steps_interval),
                     f"{fmt(r.tokens_per_s_baseline)} / {fmt(r.tokens_per_s)}",
                     with_interval(r.speedup, r.speedup_interval) + "×",
                     with_interval(r.speedup_wall, r.speedup_wall_interval) + "×",
                     f"{fmt(watch['lookup']['speedup'])}×" if watch.get("lookup") else "", "", "", "", ""))
    k_table = table(rows, ("K", "vLLM τ", "vLLM tokens/s plain / spec (engine)", "vLLM speedup (engine)",
                           "vLLM speedup (stopwatch, same runs)", "vLLM speedup (independent stopwatch)",
                           "loop τ", "loop tokens/s plain / spec", "loop speedup (loop clock)",
                           "loop speedup (stopwatch)"))

    def agreement(what: str, eval_row: VllmEval | KRow, watched: dict[str, Any]) -> str:
        agree = eval_row.speedup / watched["speedup"] - 1
        return (f"Agreement {what}: the eval's speedup {fmt(eval_row.speedup)}× (engine core; "
                f"{fmt(eval_row.speedup_wall)}× by the stopwatch around the same runs) against the independent "
                f"stopwatch's {fmt(watched['speedup'])}× (rounds: "
                f"{', '.join(fmt(x) for x in watched['speedup_by_round'])}): {agree:+.1%}, "
                f"{'within' if abs(agree) <= AGREEMENT else 'NOT within'} {AGREEMENT:.0%}.")
    agreements = [agreement("at best_k", v, watch)]
    if watch.get("lookup"):
        agreements.append(agreement(f"for prompt lookup (K = {watch['lookup']['k']})", v.ngram, watch["lookup"]))
    s = report.settings
    return "\n".join([
        f"Drafter `{report.drafter.path}` on `{report.target.name if report.target else '-'}`, {s.num_prompts} "
        f"held-out prompts, up to {s.options.get('max_new_tokens')} new tokens, greedy; measured on "
        f"{describe_machine(s.machine, v.dtype)}, vLLM {v.version}.", "",
        "Speculation length K, one request at a time (best_k in bold; intervals: 95% bootstrap over prompts):", "",
        k_table, "",
        f"best_k = {v.best_k}" + (f" (the fastest in {v.best_k_share:.0%} of the resamples)"
                                  if v.best_k_share is not None else "")
        + (f"; not measured for the time budget: K = {v.timing.skipped_k}" if v.timing and v.timing.skipped_k else "")
        + ".", "",
        " ".join(agreements), "",
        *concurrency_table(v)[1:]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stopwatch_child:
        stopwatch_child(Path(args.stopwatch_child))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log: list[dict[str, Any]] = []
    report = run_eval(args, Path(args.eval_out), log)
    own = own_loop(args, report, log) if args.own_k != "" else []
    watch = stopwatch(args, report, Path(args.eval_out).with_name(Path(args.eval_out).name + "-stopwatch"), log)
    body = tables(report, own, watch)
    loads = "\n".join(f"- {e['part']}" + (" (reused: an earlier run's folder, measured by its own command)"
                                           if e.get("reused") else f" ({e['seconds']:.0f} s): before "
                                           f"`{e['uptime_before']}`, after `{e['uptime_after']}`")
                      + (f"\n  `{e['command']}`" if "command" in e else "") for e in log)
    markdown = "\n\n".join([runs.header("Serving: speculation length and concurrency", "benchmarks/bench_serving.py"),
                            body, "Load on the machine (uptime) around each part:\n\n" + loads]) + "\n"
    markdown = runs.portable(markdown)
    (out / "bench.md").write_text(markdown)
    (out / "bench.json").write_text(json.dumps(runs.portable({"own_loop": own, "stopwatch": watch, "parts": log}),
                                               indent=1))
    print("\n" + markdown)
    print(f"bench: {out / 'bench.md'}, {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    runs.script_main(main)
