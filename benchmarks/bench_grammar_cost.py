"""What a request's grammar costs a speculative step in vLLM: the same prompts and drafter, timed with and without
each request's own constraints (structured outputs), by the eval's protocol.

    python benchmarks/bench_grammar_cost.py --drafter runs/triage/drafter --prompts data/prompts/triage \
        [--split eval] [--limit 20] [--k 9] [--max-new-tokens 64] [--max-prompt-tokens 384] [--out DIR]

Two timed engine jobs (`engine.child._timed`: every prompt decoded to its natural stop by plain decoding, then
timed plain and speculative at that length, each request alone and cold, the side that goes first alternating), one
with every request's constraints and one without. Without them the target writes other answers, so the tokens a step
commits differ;
what compares is the cost of one step: a speculative verification step (its decode time over its steps) against a
plain one (decode time over tokens after the first), with and without the grammar. The grammar adds to both sides;
a speculative step also validates its drafts against the grammar and masks every verified position. Prints a
markdown table and writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dflash_train import constraints as request_constraints
from dflash_train.device import resolve_precision
from dflash_train.engine.jobs import VLLM_DTYPES, EngineJob, EngineRequest
from dflash_train.engine.runner import run_engine
from dflash_train.prompts import load_prompt_records
from dflash_train.stages.evaluate.command import LEFT_OUT
from dflash_train.support import runs
from dflash_train.target import DEFAULT_TARGET, load_target


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a DFlash drafter folder")
    p.add_argument("--prompts", required=True, help="an ingest output folder whose requests carry constraints")
    p.add_argument("--split", default="eval")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--k", type=int, default=9, help="speculation length")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--engine-args", type=json.loads, default={}, help='vLLM engine arguments as JSON, e.g. '
                   '\'{"max_num_seqs": 4}\' (the eval\'s engine with --concurrency 4)')
    p.add_argument("--constrained-only", action="store_true", help="time only the job under the constraints")
    p.add_argument("--out", default="results/bench_grammar_cost")
    return p.parse_args()


def step_costs(result) -> dict[str, float]:
    """Plain decode seconds per token and speculative decode seconds per verification step, summed over prompts
    (the decode phase: after each request's first token), and what one speculative step costs in plain steps."""
    run = result.timed["runs"][0]
    steps = {o["id"]: len(o["accepted"]) for o in run["outputs"]}
    plain_s = sum(min(t["plain_decode_s"]) for t in run["batch1"])
    spec_s = sum(min(t["spec_decode_s"]) for t in run["batch1"])
    tokens = sum(t["tokens"] - 1 for t in run["batch1"])
    n_steps = sum(steps[t["id"]] for t in run["batch1"])
    plain_step, spec_step = plain_s / tokens, spec_s / n_steps
    return {"prompts": len(run["batch1"]), "tokens": tokens, "steps": n_steps, "tokens_per_step": tokens / n_steps,
            "plain_ms_per_token": 1e3 * plain_step, "spec_ms_per_step": 1e3 * spec_step,
            "step_cost_in_plain_steps": spec_step / plain_step, "speedup_decode": plain_s / spec_s}


def heldout_requests(args: argparse.Namespace, target, constrained: bool = True) -> list[EngineRequest]:
    """The --split's first --limit requests within --max-prompt-tokens, as the eval decodes them: each under its
    own constraints (less what the eval leaves out, `LEFT_OUT`), or under none."""
    records, _ = load_prompt_records(args.prompts, args.split, args.limit)
    rendered = [(r, target.render(r.messages, r.tools)) for r in records]
    return [EngineRequest(id=r.id, prompt_token_ids=ids, max_tokens=args.max_new_tokens,
                          constraints=request_constraints.without(r.constraints, LEFT_OUT) if constrained else None)
            for r, ids in rendered if len(ids) <= args.max_prompt_tokens]


def timed_at_k(args: argparse.Namespace, target, precision, drafter: str, requests: list[EngineRequest], label: str,
               engine_args: dict | None = None):
    """The eval's timed job (`engine.child._timed`) of `requests`, plain and with `drafter` at --k; its result."""
    job = EngineJob(target=str(target.path), requests=requests, stop_token_ids=target.stop_token_ids(),
                    dtype=VLLM_DTYPES[precision.name], drafter=drafter, mode="timed",
                    max_model_len=max(len(r.prompt_token_ids) for r in requests) + args.max_new_tokens + args.k + 1,
                    speculative_tokens=[args.k], engine_args=engine_args or {})
    with tempfile.TemporaryDirectory(prefix="bench-timed-") as work:
        return run_engine(job, work, f"{label}, plain and at K = {args.k}")


def main() -> int:
    args = parse_args()
    precision = resolve_precision(args.dtype, "cpu")
    target = load_target(args.target, dtype=precision.dtype)
    figures = {}
    jobs = [("under each request's constraints", True), ("without constraints", False)]
    for label, constrained in jobs[:1] if args.constrained_only else jobs:
        requests = heldout_requests(args, target, constrained)
        figures[label] = step_costs(timed_at_k(args, target, precision, args.drafter, requests, label,
                                               args.engine_args))
        print(label, json.dumps(figures[label]), flush=True)
    rows = [[label, f["prompts"], f["tokens_per_step"], f["plain_ms_per_token"], f["spec_ms_per_step"],
             f["step_cost_in_plain_steps"], f["speedup_decode"]] for label, f in figures.items()]
    table = runs.markdown_table(["requests", "prompts", "decode tokens / step", "plain ms / token",
                                 "speculative ms / step", "a step in plain steps", "speedup (decode phase)"], rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "figures": figures}, indent=1) + "\n")
    (out / "results.md").write_text(f"# What a grammar costs a speculative step (K = {args.k})\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
