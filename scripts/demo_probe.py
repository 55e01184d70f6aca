"""`make demo`'s probe: about a minute of measurements on this machine, before anything long starts.

Plain decoding at batch 1 (and in fp32 where the stages compute in less: the eval reruns its mismatches in fp32),
training steps of the demo recipe's shape with stored states and with the states computed online, the capture as it
will run (the one-pass capture of two batches of training prompts at the 0.21 and 0.79 quantiles of their lengths,
or vLLM's of a sample), and, where the demo evaluates in vLLM, a few requests timed there as the eval times them, in
the same engine child as vLLM's capture; all in the compute dtype the stages will pick. scripts/demo_plan.py sizes
the stages from these rates. Also here: what the probe and the plan both read, the demo's recipe and its training
prompts as capture renders them."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from dflash_train.engine.jobs import FREE_NAMES
from dflash_train.errors import UserError
from dflash_train.support.runs import REPO
GAUSS_QUANTILES = (0.5 - 0.5 / 3 ** 0.5, 0.5 + 0.5 / 3 ** 0.5)  # the probe's capture batches (two-point quadrature)
ENGINE_PROBE_PROMPTS = 24
ENGINE_DECODE_PROBE_PROMPTS = 3


# --- what the probe and the plan read -------------------------------------------------------------------------------


def demo_recipe(args: argparse.Namespace):
    """The recipe with the demo's overrides, resolved as train.py resolves it (paths relative to the repo)."""
    import os

    from dflash_train.stages.train.recipe import load_recipe

    here = os.getcwd()
    os.chdir(REPO)
    try:
        return load_recipe(args.recipe, args.train_override)
    finally:
        os.chdir(here)


def drafter_layers(recipe) -> int:
    """How many layers the drafter this recipe trains has: the starting drafter's under drafter.init_from."""
    from dflash_train.stages.train.drafter import NEW_DRAFTER_LAYERS

    if recipe.drafter.init_from is not None:
        from dflash_train.model.published import fetch_drafter

        config = json.loads((fetch_drafter(recipe.drafter.init_from, recipe.drafter.init_revision).folder
                             / "config.json").read_text())
        return int(config.get("num_hidden_layers") or config["transformer_layer_config"]["num_hidden_layers"])
    return recipe.drafter.num_layers or NEW_DRAFTER_LAYERS


@functools.lru_cache(maxsize=4)
def rendered_prompts(prompts: Path, split: str, limit: int, target: str) -> tuple[tuple[list[int], dict | None], ...]:
    """The first `limit` prompts of `split` as capture replays them: each one's token ids, rendered as capture
    renders them (chat template and tool definitions), and its request's constraints (structured outputs, stop
    strings, ...); cached, as the probe and the plan both read the training prompts (2,000 take ~9 s)."""
    from dflash_train.prompts import load_prompt_records
    from dflash_train.target import load_tokenizer, render_prompt

    tokenizer = load_tokenizer(target)
    records, _ = load_prompt_records(prompts, split, limit)
    return tuple((render_prompt(tokenizer, r.messages, r.tools), r.constraints) for r in records)


# --- the probe ------------------------------------------------------------------------------------------------------


def probe(args: argparse.Namespace, prompts: Path, dtype: str = "auto",
          check: Callable[[dict], None] | None = None) -> dict[str, float | str]:
    """About a minute of measurements on this machine, in the compute dtype the stages will use (`auto`). `check`
    (the demo's: the plan's early check) is given the decode rates (and the one-pass capture's, where it captures) as
    soon as they are in, before the training-step and vLLM measurements: it refuses a budget the eval alone leaves
    too little of."""
    import torch

    from dflash_train.device import default_device, resolve_precision
    from dflash_train.states import generate_and_capture
    from dflash_train.stages.capture.command import resolve_layer_ids
    from dflash_train.target import load_target

    parts: dict[str, float] = {}  # each measurement's seconds (`probe_s`), so that a slow probe says where

    def part(name: str, fn, *a, **kw):
        out, parts[name] = timed(fn, *a, **kw)
        return out

    device = default_device()
    precision = resolve_precision(dtype, device)
    target = part("target", load_target, args.target, dtype=precision.dtype, device=device)
    requests = sorted((r for r in rendered_prompts(prompts, "train", args.capture_limit, args.target)
                       if len(r[0]) <= args.max_prompt_tokens), key=lambda r: len(r[0]))  # what capture keeps
    rendered = [ids for ids, _ in requests]
    if not rendered:
        raise UserError(f"no training prompt of the first {args.capture_limit} in {prompts} fits --max-prompt-tokens "
                        f"{args.max_prompt_tokens}: raise it (or --capture-limit)")
    layers = resolve_layer_ids(target.num_layers, None, 5)  # capture's default taps
    engine_capture = who_captures(args) == "vllm"
    first: dict = {"precision": precision.describe()}
    if not engine_capture:  # the one-pass loop captures: its rates
        stop, pad = target.stop_token_ids(), target.tokenizer.pad_token_id
        part("capture warm-up", generate_and_capture, target.model, rendered[:2], layers, 2, stop, pad)
        first.update(part("capture", capture_rates, args, target, rendered, layers))
    median_prompt = rendered[len(rendered) // 2]
    first.update(part("decode", decode_rates, target.model, median_prompt))
    if precision.dtype != torch.float32:  # the eval reruns its mismatches in fp32: the plan counts that rerun
        fp32 = part("fp32 target", load_target, args.target, dtype=torch.float32, device=device).model
        first.update(part("fp32 decode", decode_rates, fp32, median_prompt, "fp32_"))
    if check is not None:
        check(first)

    recipe = demo_recipe(args)
    state_bytes = 2.0 * len(layers) * target.config.hidden_size  # bf16 states, a token's
    steps = part("training steps", training_step_rates, args, target, layers, recipe, precision.dtype,
                 torch.device(device), online_step_needed(args, state_bytes))
    engine = {}
    if engine_capture or (args.engine != "own" and recipe.drafter.init_from is not None):
        engine = part("vLLM", probe_engine, args, target, requests, layers, precision, recipe, engine_capture)
    return {**first, "cpu_capability": torch.backends.cpu.get_cpu_capability(), **engine,
            "state_bytes_per_token": state_bytes,
            **steps, "probe_s": {name: round(seconds, 1) for name, seconds in parts.items()}}


def who_captures(args: argparse.Namespace) -> str:
    """Who generates the training responses: --capture-engine, and under auto vLLM wherever it is installed: it
    captured faster than the one-pass loop on every host measured (0.73 s a prompt against 1.12 on the 2-core AVX-512
    BF16 host, 1.16 against 1.28 there in fp32 with AVX2 kernels, 1.69 against 2.13 on the AVX2 host; the states'
    prefill included), so the probe measures only the way capture will run (the two took 85-110 s of it). The rule
    of the probe, and of the demo without a plan (--no-plan)."""
    from dflash_train.engine.install import vllm_version

    if args.capture_engine != "auto":
        return args.capture_engine
    return "vllm" if vllm_version() is not None else "own"


def timed(fn, *a, **kw):
    """(fn(*a, **kw), the seconds it took)."""
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


def capture_rates(args: argparse.Namespace, target, rendered: list[list[int]], layers: list[int]) -> dict:
    """The one-pass capture's seconds per prompt (their mean, and each batch's), its batch size, new tokens per
    second and tokens per sample (new, and prompt and response).

    Whole batches as the capture stage runs them (prompts of similar length, up to T new tokens each, rows stopping
    at the stop tokens, top-k log-probs), timed end to end: a decode step costs more as the cache grows and the
    top-k head runs over every prompt position, so a short probe extrapolated to T tokens was off by 2-3x either
    way (the 2026-12-01 trial: 271 new tokens/s planned, 28 measured). A prompt's cost grows with its length
    (the AVX-512 demo: 2.9 s each for the longest 64 of 450, 1.1 for the shortest), so one batch at the median
    length planned 1.03 s for a capture that took 1.72 s per prompt: the mean over the length distribution is
    taken by two-point Gauss-Legendre quadrature over its quantiles, a batch at quantile 0.21 and one at 0.79."""
    from dflash_train.states import generate_and_capture

    stop, pad = target.stop_token_ids(), target.tokenizer.pad_token_id
    timings, new_tokens, all_tokens = [], 0, 0
    for q in GAUSS_QUANTILES:
        at = min(max(0, round(q * len(rendered)) - args.batch_size // 2), max(0, len(rendered) - args.batch_size))
        batch = rendered[at:at + args.batch_size]
        captured, seconds = timed(generate_and_capture, target.model, batch, layers, args.max_new_tokens, stop, pad,
                                  topk=args.store_topk)
        timings.append(seconds / len(batch))
        new_tokens += sum(len(c.input_ids) - c.num_prompt_tokens for c in captured)
        all_tokens += sum(len(c.input_ids) for c in captured)
    capture_s_per_prompt = sum(timings) / len(timings)
    samples = len(batch) * len(timings)
    return {"capture_batch": len(batch), "capture_s_per_prompt": capture_s_per_prompt,
            "capture_s_per_prompt_by_quantile": timings,
            "capture_new_tok_s": new_tokens / (capture_s_per_prompt * samples),
            "capture_mean_new_tokens": new_tokens / samples, "capture_mean_tokens": all_tokens / samples}


def decode_rates(model, prompt: list[int], prefix: str = "") -> dict[str, float]:
    """Plain decoding of `prompt` (the median one) at batch 1: new tokens/s, the prefill taken out (24 new tokens
    against 4), and the prompt's prefill, which every request the eval times runs once more (0.7-1.2 s against
    6.2-6.6 s for 64 tokens on the AVX2 host); the median of three such pairs (one pair read 7.2 to 10.8
    tokens/s within a minute on that host, and the eval's plan scales with it)."""
    from dflash_train.spec_decode.loop import plain_generate

    pairs = []
    for _ in range(3):
        (_, short), (long_, long_s) = (timed(plain_generate, model, prompt, n, []) for n in (4, 24))
        pairs.append((20 / max(2e-3, long_s - short), long_.prefill_s))
    return {f"{prefix}decode_tok_s": statistics.median(rate for rate, _ in pairs),
            f"{prefix}prefill_s": statistics.median(prefill for _, prefill in pairs)}


def online_step_needed(args: argparse.Namespace, state_bytes_per_token: float) -> bool:
    """Whether the plan may train on states computed online, so that the probe times such a step: --hidden-states
    online, or auto where the disk may not hold the states of every prompt capture can read (--capture-limit x
    (--max-prompt-tokens + --max-new-tokens) tokens, against measure.DISK_SHARE of the free disk). Elsewhere stored
    states win at any rates: both ways to capture record the states in the forwards that generate, so a token-only
    capture saves nothing, and a step on stored states costs less than one that computes them (3.4x on the AVX2
    host). Its three online steps were 6-7 s of that host's probe."""
    import shutil

    from dflash_train.support.measure import DISK_SHARE

    if args.hidden_states != "auto":
        return args.hidden_states == "online"
    most = args.capture_limit * (args.max_prompt_tokens + args.max_new_tokens) * state_bytes_per_token
    return most > DISK_SHARE * shutil.disk_usage(Path(args.workdir)).free


def training_step_rates(args: argparse.Namespace, target, layers: list[int], recipe, dtype, device,
                        online: bool = True) -> dict:
    """Seconds per training step of the recipe's shape (dflash_train.support.measure's step, random data at the longest
    sample capture keeps, the head cut to the recipe's draft vocabulary size) with stored states and, alternating,
    where `online`, with the states computed online as the trainer does (data.hidden_states: online: the target
    prefills the micro batch first, benchmarks/bench_online.py's probe); the median of each after its first."""
    import torch

    from dflash_train.stages.train.data import OnlineStates
    from dflash_train.support import measure

    cfg = target.config
    step_args = argparse.Namespace(hidden=cfg.hidden_size, layers=drafter_layers(recipe), target_layers=5,
                                   vocab=cfg.vocab_size, seq=args.max_prompt_tokens + args.max_new_tokens,
                                   anchors=recipe.objective.num_anchors, block=recipe.drafter.block_size,
                                   batch=recipe.train.micro_batch_size, attention="blockwise", head="fused",
                                   head_chunk=recipe.objective.head_chunk_tokens)
    drafter = measure.make_drafter(step_args, device, dtype)
    g = torch.Generator().manual_seed(1)
    embed = (torch.randn(step_args.vocab, step_args.hidden, generator=g) * 0.02).to(dtype)
    # a draft vocabulary (drafter.draft_vocab_size): the loss scores at most that many rows of the head
    head_rows = min(step_args.vocab, recipe.drafter.draft_vocab_size or step_args.vocab)
    data = {"input_ids": torch.randint(0, head_rows - 1, (step_args.batch, step_args.seq), generator=g),
            "loss_mask": torch.ones(step_args.batch, step_args.seq, dtype=torch.bool),
            "hidden_states": torch.randn(step_args.batch, step_args.seq, 5 * step_args.hidden, generator=g).to(dtype),
            "position_ids": torch.arange(step_args.seq).expand(step_args.batch, -1)}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    states = OnlineStates(target, layers, step_args.seq) if online else None
    rows = [[{"input_ids": ids}] for ids in data["input_ids"]]
    times: dict[str, list[float]] = {"stored": [], "online": []}
    for step in range(7 if online else 4):
        source = ("stored", "online")[step % 2] if online else "stored"
        t0 = time.perf_counter()
        batch_data = data if source == "stored" else {**data, "hidden_states": torch.stack(
            [row[0]["hidden_states"] for row in states.add(rows)]).to(dtype)}
        measure.step_fn(step_args, drafter, embed, embed[:head_rows], batch_data, optimizer, step)
        times[source].append(time.perf_counter() - t0)
    return {"train_step_s": statistics.median(times["stored"][1:]),
            **({"train_online_step_s": statistics.median(times["online"][1:])} if online else {})}


# --- vLLM -----------------------------------------------------------------------------------------------------------


def probe_engine(args: argparse.Namespace, target, requests: list[tuple[list[int], dict | None]],
                 layers: list[int], precision, recipe, capture: bool) -> dict[str, float | dict[str, float]]:
    """vLLM as the stages run it, in one engine child (one start: 14-70 s of a probe that was two children):

    - with `capture` (capture --engine vllm), the engine capture of ENGINE_PROBE_PROMPTS training prompts spread over
      the length distribution (every k-th by length; `requests`: rendered_prompts' by length): their responses under
      their requests' constraints with continuous batching, the states and top-k recorded in the same forwards
      (`engine.taps`; the hooks are taken off after). Gives the start-up (the engine process and vLLM's load, once
      per capture), the seconds per prompt after it, and the sample's mean lengths. Continuous batching packs more
      requests together in a real capture than in this sample, and the sample runs at vLLM's KV block where the
      capture runs at a smaller one (the timed engines keep the eval's), so it errs on the slow side.
    - with a starting drafter and the eval in vLLM, the eval's own protocol (`eval --engine vllm`'s timed job) on
      ENGINE_DECODE_PROBE_PROMPTS training prompts of the median length, up to --eval-max-new-tokens: plain decoding,
      the starting drafter at K = 1 and B - 1 (probe_ks), and suffix decoding at the demo's first K (--suffix; else
      prompt lookup at its first, --ngram; with no capture sample, both), every speculator beside the same plain run,
      each request alone and cold. Gives vLLM's whole-request rate at batch 1 (at the eval's mean request length:
      `eval_length_rates`) and that length (where answers stop before its cap; from the capture sample's answers, where
      there is one: three prompts are too few), the starting drafter's time over plain's (at the faster K), each free
      speculator's (`engine_free_slowdown`: what the eval's runs of it cost; with a capture sample, from its tau walked
      over the sample's answers, `eval_length_rates`), the speculative engines' start (their median), and what a
      verification step costs in plain decoding steps, the line a + b x K through the two K (`engine_step_cost`: the
      eval's --step-cost, from which its sweep starts at the K of the best expected speed; the triage demo's drafter
      under its schema on the 2-core AVX-512 host: 1.40 at K = 1, 1.47 at 4, 1.64 at 9, 1.87 at 15). Without it the plan
      counted the project's own loop's decode rate and ENGINE_SLOWDOWN for every K: on the AVX-512 BF16 host 265 s a K
      for about 130. The timed requests are decoded without their constraints, though the eval decodes under them: what
      a grammar does to a step depends on the drafter, and the probe has only the starting one. The first K depends on
      the line's slope over its intercept; measured on the 2-core AVX-512 host, the drafters the demo trains, under
      their schema: 0.016 (router, 1.43 + 0.023 x K) and 0.018 (triage); the general drafter under the same schemas:
      0.010, 0.005, 0 and 0, which started triage's sweep at K = 9 for 1.20x; without them: 0.028, 0.021 and 0.008."""
    import tempfile

    from dflash_train.engine.jobs import VLLM_DTYPES, EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine

    work = tempfile.TemporaryDirectory(prefix="demo-probe-engine-")
    sample = requests[::max(1, len(requests) // ENGINE_PROBE_PROMPTS)][:ENGINE_PROBE_PROMPTS] if capture else []
    sample_requests = [EngineRequest(id=f"capture-{i}", prompt_token_ids=ids, max_tokens=args.max_new_tokens,
                                     constraints=c) for i, (ids, c) in enumerate(sample)]
    decoding = args.engine != "own" and recipe.drafter.init_from is not None
    asked = [*(("ngram", k) for k in args.ngram[:1]), *(("suffix", k) for k in args.suffix[:1])]  # free, first K
    lengths = [len(ids) + args.max_new_tokens + 1 for ids, _ in sample]  # + 1: the states' tail re-run
    job = EngineJob(target=str(target.path), requests=sample_requests, stop_token_ids=target.stop_token_ids(),
                    dtype=VLLM_DTYPES[precision.name], max_model_len=max(lengths, default=1), mode="batch",
                    states_to=str(Path(work.name) / "states") if capture else None, state_layers=layers,
                    state_topk=args.store_topk)
    ks: tuple[int, int] = (1, 2)
    if decoding:
        from dflash_train.model.published import fetch_drafter

        rendered = [ids for ids, _ in requests]
        middle = len(rendered) // 2
        picked = rendered[max(0, middle - ENGINE_DECODE_PROBE_PROMPTS // 2):][:ENGINE_DECODE_PROBE_PROMPTS]
        drafter = fetch_drafter(recipe.drafter.init_from, recipe.drafter.init_revision).folder
        ks = probe_ks(min(json.loads((drafter / "config.json").read_text())["block_size"], recipe.drafter.block_size))
        free = [("dflash", ks[1]), *(asked[-1:] if capture else asked)]  # with a sample, one: their step's cost
        job = replace(job, mode="timed", drafter=str(drafter), speculative_tokens=[ks[0]], free=free,
                      capture_sample=sample_requests, requests=[
                          EngineRequest(id=str(i), prompt_token_ids=ids, max_tokens=args.eval_max_new_tokens)
                          for i, ids in enumerate(picked)],
                      max_model_len=max([*lengths, *(len(ids) + args.eval_max_new_tokens + ks[1] + 1
                                                     for ids in picked)]))
    what = " and ".join([*(["generating responses"] if capture else []),
                         *([f"decoding at batch 1, plain, the starting drafter at K = {ks[0]} and {ks[1]}"
                            + "".join(f", {FREE_NAMES[m]} at K = {k}" for m, k in job.free if m != "dflash")]
                           if decoding else [])])
    started = time.perf_counter()
    with work:
        result = run_engine(job, work.name, f"demo probe: vLLM {what}")
    rates: dict = {"engine_start_s": time.perf_counter() - started - result.wall_s}
    if capture:
        new = [len(o.token_ids) for o in (result.capture_sample if decoding else result.outputs)]
        rates.update({"engine_capture_s_per_prompt": (result.capture_sample_s if decoding else result.wall_s)
                      / len(sample), "capture_mean_new_tokens": statistics.mean(new),
                      "capture_mean_tokens": statistics.mean(len(ids) for ids, _ in sample) + statistics.mean(new)})
    if decoding:
        rates.update(engine_decoding_rates(result))
        if capture and args.max_new_tokens >= args.eval_max_new_tokens:  # the eval's cap on the sample's answers:
            rates["engine_mean_new_tokens"] = statistics.mean(  # 43 tokens by the timed 3 router prompts, 62 by the
                min(n, args.eval_max_new_tokens) for n in new)   # 24 (the eval's held-out 20 decoded 62)
        if capture:  # plain decoding at the eval's length; the free speculators walked over the sample's answers
            at_length = eval_length_rates(result, sample_requests, args.eval_max_new_tokens,
                                          rates["engine_mean_new_tokens"], asked)
            rates["engine_free_slowdown"].update(at_length.pop("engine_free_slowdown", {}))
            rates.update(at_length)
    return rates


def engine_decoding_rates(result) -> dict[str, float | list[float] | dict[str, float]]:
    """`probe_engine`'s decoding figures from its timed result, read as the eval reads its runs."""
    from dflash_train.stages.evaluate.vllm_sweep import k_row, step_cost_line

    runs = result.timed["runs"]
    natural = result.by_id()
    rows = [(run["method"], run["k"], k_row(run, natural, greedy=True)) for run in runs]
    drafter = {k: row for method, k, row in rows if method == "dflash"}
    tokens = sum(t["tokens"] for run in runs for t in run["batch1"])
    plain_s = sum(sum(t["plain_wall_s"]) for run in runs for t in run["batch1"])
    costs = {k: row.step_cost for k, row in drafter.items()}
    return {"engine_plain_tok_s": tokens / plain_s,
            "engine_spec_slowdown": min(1 / row.speedup_wall for row in drafter.values()),
            "engine_free_slowdown": {method: 1 / row.speedup_wall for method, _, row in rows if method != "dflash"},
            "engine_spec_start_s": statistics.median(run["load_s"] for run in runs),
            # what the eval's requests decode, its cap or their natural stop before it: these few, unless the capture
            # sample's answers tell it (`probe_engine`)
            "engine_mean_new_tokens": statistics.mean(len(o.token_ids) for o in result.outputs),
            **({"engine_step_cost": step_cost_line(costs)} if None not in costs.values() else {})}


def eval_length_rates(result, sample: list, cap: int, new_tokens: float, free: list[tuple[str, int]]) -> dict:
    """Plain decoding's and the free speculators' figures at the eval's request length (`new_tokens`, the capture
    sample's answers under the eval's cap), from the timed runs and the capture sample's answers (`sample`: its
    EngineRequests, each paired with its answer by id; a request the engine refused has none):

    - plain decoding's whole-request rate at that length: its timed runs' fixed part (the prefill and the engine's
      overhead: their wall less their decode phase) once, then its tokens at the decode phase's rate. The three timed
      prompts stop earlier than the eval's (43 tokens against 62 on the router), so their own rate over-weighted the
      fixed part.
    - the time over plain decoding's of each free speculator of `free` (method, K): its tau walked over the capture
      sample's answers (`spec_decode.walk`, each cut at the eval's cap, in the sample's order: suffix decoding's tree
      holds the answers before each) at what a step of the free speculators costs in plain decoding steps (the
      eval's `step_cost` of the one the probe timed, `probe_engine`: a step verifies a draft made without a model;
      the eval measured prompt lookup's and suffix decoding's within 5% of each other on both hosts). The three
      timed prompts alone measured 1.01x and 1.11x on the AVX2 host where the eval's twenty measured 1.19x and 1.52x
      (1.72x and 1.81x against 1.26x and 1.64x on the AVX-512 one); the walk over the eval's own answers gives
      vLLM's tokens and its steps within 4%. Without a timed step cost or a walked step, the timed figures stay
      (`engine_decoding_rates`)."""
    from dflash_train.spec_decode.walk import free_walk
    from dflash_train.stages.evaluate.vllm_sweep import k_row

    natural, runs = result.by_id(), result.timed["runs"]
    rows = [(run, k_row(run, natural, greedy=True)) for run in runs]
    plain = rows[0][1].per_prompt  # plain decoding's runs, shared by every speculator
    fixed_s = statistics.mean(p.plain_wall_s - p.plain_decode_s for p in plain)
    decode_s = max(0.0, new_tokens - 1) * sum(p.plain_decode_s for p in plain) / max(
        1, sum(p.new_tokens - 1 for p in plain))
    rates: dict = {"engine_plain_tok_s": new_tokens / (fixed_s + decode_s)}
    timed = [row for run, row in rows if run["method"] != "dflash" and row.step_cost and row.num_steps]
    if not timed:
        return rates
    cost = sum(row.step_cost * row.num_steps for row in timed) / sum(row.num_steps for row in timed)
    answered = {output.id: output.token_ids for output in result.capture_sample}
    answers = [(r.prompt_token_ids, answered[r.id]) for r in sample if r.id in answered]
    taus = {method: tau for method, k in free if (tau := free_walk(method, answers, k, cap).tau)}
    return {**rates, "engine_free_tau": {m: round(tau, 3) for m, tau in taus.items()},
            "engine_free_step_cost": round(cost, 3),
            "engine_free_slowdown": {m: (fixed_s + decode_s * cost / tau) / (fixed_s + decode_s)
                                     for m, tau in taus.items()}}


def probe_ks(block_size: int) -> tuple[int, int]:
    """The two speculation lengths the probe times the starting drafter at: the ends of the range the drafter the
    demo trains is served in, 1 and B - 1 (B the recipe's block, where the starting drafter's is no shorter)."""
    return (1, max(2, block_size - 1))
