"""`make demo`'s plan: the stages sized to the budget on this machine, from the probe's rates (scripts/demo_probe.py).

The eval gets what it costs (20 held-out prompts, the drafter at one K in vLLM, the engine's own speculators where
asked, the fp32 rerun of low-precision mismatches), the rest goes to capture (prompts read) and training
(`train.time_budget_s`, at most the recipe's max_steps; after the capture, plus what it saved against its plan or less
what it overran). It stores the states with the responses, or captures token-only and trains online
(`data.hidden_states: online`), whichever costs less per token at the epochs the plan trains
(dflash_train.support.measure's rule). Where the eval as asked would leave capture and training less than
CAPTURE_AND_TRAIN_SHARE of the time, the eval is cut first (EVAL_CUTS: one K for each free speculator, then the free
speculators on fewer prompts), and the plan says what it left out. A budget too short for this machine even so is
refused, naming the one that fits, as early as the probe can tell.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from demo_probe import ENGINE_DECODE_PROBE_PROMPTS, ENGINE_PROBE_PROMPTS, demo_recipe, rendered_prompts

from dflash_train.device import default_device
from dflash_train.engine.child import idle_s
from dflash_train.engine.jobs import FREE_NAMES
from dflash_train.errors import UserError

VLLM_START_S = 25.0  # the engine's child process on a 2-core CPU: its start, vLLM's import, the plain engine
#                    (BENCHMARKS "vLLM on CPU in one process": 24 s on the AVX2 host); the probe's measurement, where
#                    it has one (`engine_start_s`), replaces it
SPEC_ENGINE_START_S = 5.0  # one more engine inside that child: the drafter's, per K (1.6-4.5 s there)
STAGE_START_S = 25.0  # a stage command's own start: python, torch, transformers, the target
DRAFT_SLOWDOWN = 2.6  # speculative decode time / plain in the project's loop for a weak drafter (the AVX2 demo at
#                      tau 1.18: 0.39x; 2.0 planned its eval 99 s short)
ENGINE_SLOWDOWN = 1.7  # the same in vLLM at the slowest K, B - 1 at a low tau (0.59x at tau 1.31 in the AVX2
#                       router demo; 1.3, the mean of two K, planned a sweep that ran one K only: the next K starts
#                       only while the budget still holds the costliest one's again)
FREE_SLOWDOWN = 1.0  # the same for prompt lookup and suffix decoding (no model to run: a K costs the verification
#                     of its drafts): 1.14x at K = 3 on the AVX2 host, where 1.7 planned 482 s for 372; 1.29x at K = 4
#                     and suffix 1.63x at K = 8 on the AVX-512 one, where 1.7 planned 544 s for about 250
FP32_RECHECK_SHARE = {"own": 1.0, "vllm": 0.55}  # of the eval's prompts that differ from plain decoding in bf16
#                      and are rerun in fp32 (near-ties rounded differently): 5 of 5 in the project's loop and 12 of
#                      20 in vLLM in the AVX-512 rewrite demo (unplanned, 143 s over its eval's plan), 2 of 5 and 11
#                      of 20 in the unseen-log demo, 10 (the drafter) and 12 (the combined speculator) of 20 in the
#                      AVX-512 router demo, 4 of 5 and 1-3 of 20 in earlier ones
TRAINED_SPEEDUP = 1.3  # the drafter the demo trains, in vLLM at its first K, against plain decoding: what its timed
#                       runs and fp32 rechecks cost. Unknown before it is trained; the router demos measured 1.52x
#                       (AVX-512 BF16), 1.35x (fp32, AVX2 kernels) and 1.26x (AVX2): counting the starting drafter's
#                       0.87x instead planned those evals 31-38% long
MIN_EVAL_PROMPTS = 20  # fewer cannot tell a 10% speedup from noise (the serving issue: 5 prompts said 0.63x-1.27x)
OWN_EVAL_PROMPTS = 5  # the project's loop decodes the first 5 of them: it runs three passes per prompt
EVAL_CONCURRENCY = 4  # requests decoded together, timed beside batch 1 (benchmarks/bench_serving.py times more)
CAPTURE_SHARE = 0.3  # of the rest: capture (more conversations) vs training (more steps); the 21-minute demo on an
                     # AVX-512 machine spent 257 s capturing and 742 s training. Time training cannot use (the recipe's
                     # max_steps reached) goes to capture too: on this budget the data, not the steps, limits tau
                     # (BENCHMARKS: 3x the steps on the same data bought 0.01)
MIN_CAPTURE_AND_TRAIN_S = 120.0  # less is not a demo of training: the plan refuses and names the budget that fits
CAPTURE_AND_TRAIN_SHARE = 0.5  # of the time left after ingest, the probe and the stages' starts: where the eval as
#                               asked leaves capture and training less, the eval is cut first (EVAL_CUTS, in order)
FREE_EVAL_PROMPTS = 10  # the free speculators' prompts in the second cut (eval --free-limit; the drafter keeps all
#                        MIN_EVAL_PROMPTS): on the AVX2 host they were most of the eval (614-760 s planned of ~1,000)
EVAL_CUTS = ("one K each for prompt lookup and suffix decoding",
             f"prompt lookup, suffix decoding and the combined speculator timed on the first {FREE_EVAL_PROMPTS} "
             f"prompts (the drafter on all)")
MARGIN = 0.05  # of the budget, kept free for what the model above does not see
PROBE_STEP_CAPTURES = {"stored": 2.1, "online": 3.5}  # a probe's training step in one-pass captures of a prompt, at
#                      most: 8.09 s (13.26 online) against 3.88 s and 7.83 (12.2) against 4.08 on the AVX2 host,
#                      0.97 (1.50) against 0.73 on the AVX-512 BF16 one (BENCHMARKS "... on a 2-core AVX2 host")
SLOW_VLLM_START_S = 100.0  # the slowest engine start a probe measured (99.8 s on the AVX2 host, 36 s there on
#                           2026-12-05, 43-45 s on the AVX-512 one): the early check's estimate, so that the budget it
#                           names errs long


# --- the eval's share of the budget, checked as early as the probe can -----------------------------------------------


def kept_prompts(prompts: Path, split: str, limit: int, target: str, max_prompt_tokens: int) -> list[int]:
    """kept[i] = how many of the first i+1 prompts of `split` capture keeps (rendered <= max_prompt_tokens)."""
    kept, n = [], 0
    for ids, _ in rendered_prompts(prompts, split, limit, target):
        n += len(ids) <= max_prompt_tokens
        kept.append(n)
    return kept


def read_for(kept: list[int], wanted: int) -> int:
    """How many prompts to read (--limit) so that `wanted` of them are kept (all there are, if fewer)."""
    return next((i + 1 for i, k in enumerate(kept) if k >= wanted), len(kept))


def eval_plan(args: argparse.Namespace, prompts: Path, rates: dict, spent_s: float,
              unmeasured_s: float = 0.0) -> dict:
    """The eval's part of the plan, and what it leaves capture and training (`flexible`), or a UserError naming the
    --budget-min that fits. Needs only the capture and decode rates, so the probe checks it before its slower
    measurements (a budget refused then is refused later too: the spent time only grows); the budget it names
    counts `unmeasured_s` more, the probe's estimate of what it has still to run (`probe_rest_s`).

    Start-ups are fixed costs (the engine's child as the probe's engine capture measured it, else VLLM_START_S;
    one more engine in it per speculator); the eval is MIN_EVAL_PROMPTS held-out prompts (each captured for the
    offline estimate), the first OWN_EVAL_PROMPTS of them in the project's loop (plain, drafter and block-size-1
    passes), all of them in vLLM (each prompt decoded by plain decoding to its natural stop, its timed run, and by
    the drafter at that length, after its engine's start, and EVAL_CONCURRENCY requests together), and in a
    low-precision eval the fp32 rerun of FP32_RECHECK_SHARE of them at the probe's fp32 rates. Every request is
    timed cold: the probe's prefill of the median prompt, then its tokens at the decode rate (without the prefill,
    the AVX2 router demo's reference pass was planned 124 s and took ~160). The K sweep (`eval --sweep-budget-s`) is
    one K: the first, the K of the best expected speed by the probe's step cost (`eval --step-cost`), which the
    eval's budget rule then times alone (a sweep planned at a share of the budget timed one K and left the rest
    unused: 426 s of a planned 583 in the router demo, 2026-12-07). vLLM's requests cost what the probe timed there
    (`probe_engine`: its batch-1 rate; the trained drafter at TRAINED_SPEEDUP), else the project's loop's rate and
    ENGINE_SLOWDOWN. Prompt lookup's K (--ngram) and suffix decoding's (--suffix) run whatever the budget, beside
    the drafter's first K and sharing plain decoding's runs: each costs its engine's start and its own runs at the
    speed the probe measured (else FREE_SLOWDOWN) (`lookup_s`); the combined speculator (--combined) a K at the
    fastest of those speeds beside plain decoding's runs in an engine child of its own, with its fp32 recheck as
    the drafter's. The held-out capture (a stage of its own) runs as the training capture does. Where that leaves
    capture and training less than CAPTURE_AND_TRAIN_SHARE of the time after the starts, the eval is cut, one cut of
    `eval_cuts` on top of the other, until it does or none is left; the refusal counts the smallest eval."""
    T = args.eval_max_new_tokens
    own, engine = args.engine != "vllm", args.engine != "own"
    engine_start_s = rates.get("engine_start_s", VLLM_START_S)
    starts = {"capture (held-out)": STAGE_START_S, "eval": STAGE_START_S + (engine_start_s if engine else 0.0),
              "push (dry run)": 10.0, "capture": STAGE_START_S, "train": STAGE_START_S}
    prefill_s, decode_s = rates["prefill_s"], T / rates["decode_tok_s"]  # one request at batch 1: its prompt, T tokens
    heldout_start_s, heldout_s = heldout_costs(rates)  # the held-out capture runs as the training capture does
    starts["capture (held-out)"] += heldout_start_s
    eval_kept = kept_prompts(prompts, "eval", args.eval_limit, args.target, args.max_prompt_tokens)
    n_eval = min(eval_kept[-1], MIN_EVAL_PROMPTS)
    n_own = min(n_eval, OWN_EVAL_PROMPTS) if own else 0

    def pair_s(prefill: float, decode: float, slowdown: float) -> float:
        """One prompt decoded plain, then speculatively, each from its own prefill."""
        return 2 * prefill + decode * (1 + slowdown)

    own_s = n_own * (pair_s(prefill_s, decode_s, DRAFT_SLOWDOWN) + prefill_s + decode_s)  # and block size 1
    # vLLM's requests: at its measured batch-1 rate and the trained drafter's expected speed where the probe timed
    # them (`probe_engine`), else at the project's loop's rate and the worst slowdown
    measured = "engine_plain_tok_s" in rates
    engine_prefill_s, engine_decode_s = (0.0, min(T, rates.get("engine_mean_new_tokens", T)) / rates[
        "engine_plain_tok_s"]) if measured else (prefill_s, decode_s)  # a request to its natural stop, at most T
    drafter_slowdown = 1 / TRAINED_SPEEDUP if measured else ENGINE_SLOWDOWN
    spec_start_s = rates["engine_spec_start_s"] if measured else SPEC_ENGINE_START_S
    free_slowdown = {**{m: FREE_SLOWDOWN for m in ("ngram", "suffix")}, **rates.get("engine_free_slowdown", {})}
    # the combined speculator drafts the drafter's blocks and the others' where they are likelier: at least the
    # fastest of them (1.79x against the drafter's 1.52 and suffix decoding's 1.65 in the AVX-512 router demo)
    combined_slowdown = min([drafter_slowdown, *(free_slowdown[m] for m in ("ngram", "suffix") if getattr(args, m))])

    idle = idle_s(default_device())  # before each timed request

    def per_k_s(slowdown: float, n: int = n_eval) -> float:
        """One K in vLLM: its speculative engine's start, then each of n prompts and the concurrent requests timed."""
        return spec_start_s + (n + EVAL_CONCURRENCY / 2) * (
            pair_s(engine_prefill_s, engine_decode_s, slowdown) + 2 * idle)

    def alone_s(slowdown: float, n: int) -> float:
        """One speculator beside plain decoding's runs it shares: its engine's start, its own n prompts and the
        concurrent requests."""
        return spec_start_s + (n + EVAL_CONCURRENCY / 2) * (engine_prefill_s + engine_decode_s * slowdown + idle)

    # the K sweep: the first K only (the best expected speed by the probe's step cost), beside plain decoding's
    # reference runs (each prompt to its natural stop: plain decoding's timed run) and its concurrent requests
    sweep_s = (n_eval + EVAL_CONCURRENCY / 2) * (engine_prefill_s + engine_decode_s + idle) + \
        alone_s(drafter_slowdown, n_eval) if engine else 0.0
    combined = engine and args.combined  # the combined speculator: an engine child of its own

    def free_s(ngram: list[int], suffix: list[int], n_free: int) -> float:
        """Each K of prompt lookup and suffix decoding (beside the drafter's first K in its engine child, sharing
        plain decoding's runs: its engine's start and its own runs) and the combined speculator (an engine child of
        its own, beside plain decoding's runs), each on n_free prompts."""
        if not engine:
            return 0.0
        seconds = len(ngram) * alone_s(free_slowdown["ngram"], n_free) + \
            len(suffix) * alone_s(free_slowdown["suffix"], n_free)
        return seconds + (per_k_s(combined_slowdown, n_free) + engine_start_s if combined else 0.0)

    recheck_own_s = recheck_start_s = recheck_prompt_s = 0.0
    if "fp32_decode_tok_s" in rates:  # a low-precision eval: its mismatches are rerun in fp32, plain and speculative
        prefill32_s, decode32_s = rates["fp32_prefill_s"], T / rates["fp32_decode_tok_s"]
        recheck_own_s = FP32_RECHECK_SHARE["own"] * n_own * pair_s(prefill32_s, decode32_s, DRAFT_SLOWDOWN)
        if engine:  # one more engine child at the chosen K, untimed: plain, then speculative, to the natural stop
            fp32 = rates["decode_tok_s"] / rates["fp32_decode_tok_s"]  # vLLM's requests slow down as the loop's do
            request32_s = (engine_prefill_s * fp32, engine_decode_s * fp32) if measured else (prefill32_s, decode32_s)
            recheck_start_s = engine_start_s + spec_start_s
            recheck_prompt_s = FP32_RECHECK_SHARE["vllm"] * pair_s(*request32_s, drafter_slowdown)

    def fixed_parts(cut: dict) -> tuple[float, float]:
        """(the free speculators' seconds, the fp32 recheck's) at an eval cut `cut` (eval_cuts)."""
        recheck_s = recheck_own_s  # and vLLM's: the drafter's mismatches, and the combined speculator's
        n_free = cut["free_limit"] or n_eval
        if recheck_start_s:
            recheck_s += recheck_start_s + n_eval * recheck_prompt_s
            recheck_s += recheck_start_s + n_free * recheck_prompt_s * (1 + combined_slowdown) / (
                1 + drafter_slowdown) if combined else 0.0
        return free_s(cut["ngram"], cut["suffix"], n_free), recheck_s

    def split(budget_min: float, cut: dict, spent_s: float = spent_s) -> tuple[float, float]:
        """(what is left for capture and training, the time left after the stages' starts) in a budget of
        budget_min with the eval cut as `cut`."""
        available = budget_min * 60 * (1 - MARGIN) - spent_s - sum(starts.values())
        eval_s = own_s + n_eval * heldout_s + sum(fixed_parts(cut)) + sweep_s
        return available - eval_s, available

    cuts = eval_cuts(args, n_eval)
    for cut in cuts:  # the eval as asked, then cut step by step while capture and training get less than their share
        flexible, available = split(args.budget_min, cut)
        if flexible >= max(MIN_CAPTURE_AND_TRAIN_S, CAPTURE_AND_TRAIN_SHARE * available):
            break
    lookup_s, recheck_s = fixed_parts(cut)
    if flexible < MIN_CAPTURE_AND_TRAIN_S:
        fits = next(m for m in itertools.count(math.ceil(args.budget_min) + 1)
                    if split(m, cut, spent_s + unmeasured_s)[0] >= MIN_CAPTURE_AND_TRAIN_S)
        starts_at = f", each engine start at {engine_start_s:.0f} s" if engine else ""
        rest = f" (counting ~{unmeasured_s:.0f} s of probe to come{starts_at})" if unmeasured_s else ""
        smallest = f" ({'; '.join(cut['left_out'])})" if cut["left_out"] else ""
        raise UserError(f"--budget-min {args.budget_min:g}: the budget leaves {flexible:.0f} s for capture and "
                        f"training on this machine after {spent_s:.0f} s of ingest and probe and an eval of {n_eval} "
                        f"prompts x {T} tokens{smallest} (~{available - flexible:.0f} s); "
                        f"{measured_line(rates)}; --budget-min {fits} fits{rest}")
    return {"starts": starts, "n_eval": n_eval, "n_own": n_own, "own_s": own_s, "heldout_s": heldout_s,
            "recheck_s": recheck_s, "lookup_s": lookup_s, "eval_kept": eval_kept, "sweep_s": sweep_s,
            "flexible": flexible, "cut": cut}


def eval_cuts(args: argparse.Namespace, n_eval: int) -> list[dict]:
    """The eval as asked, then each cut of EVAL_CUTS that changes it, each on top of the ones before: the K of
    prompt lookup and suffix decoding, and the free speculators' prompts (eval --free-limit). Each: the ngram and
    suffix K, the free speculators' prompt count (None: all n_eval), and what was left out, in words."""
    cut = {"ngram": list(args.ngram), "suffix": list(args.suffix), "free_limit": None, "left_out": []}
    cuts = [cut]
    free = args.engine != "own" and bool(args.ngram or args.suffix or args.combined)
    if len(args.ngram) > 1 or len(args.suffix) > 1:
        cut = {**cut, "ngram": args.ngram[:1], "suffix": args.suffix[:1],
               "left_out": [*cut["left_out"], EVAL_CUTS[0]]}
        cuts.append(cut)
    if free and n_eval > FREE_EVAL_PROMPTS:
        cut = {**cut, "free_limit": FREE_EVAL_PROMPTS,
               "left_out": [*cut["left_out"], EVAL_CUTS[1]]}
        cuts.append(cut)
    return cuts


def heldout_costs(rates: dict) -> tuple[float, float]:
    """The held-out capture's (start-up seconds, seconds per prompt): the training capture's way, as the probe
    measured it (capture_costs); before it has (the early check), nothing."""
    return next(iter(capture_costs(rates).values()), (0.0, 0.0))


def early_check(args: argparse.Namespace, prompts: Path, first: dict, spent_s: float) -> None:
    """Refuse, before the probe's slower measurements, a budget the eval alone overruns. The engine is not
    measured yet: the refusal counts each start as 0 and the drafter's K as costing no more than plain decoding at
    the project's loop's rate, so that what it refuses the full plan refuses too; the budget it names is the one
    the plan fits with each start at SLOW_VLLM_START_S (the eval's engine, one more per further lookup K, the fp32
    recheck's) and the rest of the probe spent (`probe_rest_s`), an estimate that errs long."""
    try:
        eval_plan(args, prompts, {**first, "engine_start_s": 0.0, "engine_plain_tok_s": first["decode_tok_s"],
                                  "engine_spec_slowdown": FREE_SLOWDOWN, "engine_spec_start_s": 0.0}, spent_s)
    except UserError:
        estimated = {**first, "engine_start_s": SLOW_VLLM_START_S}  # only adds time: this plan refuses too
        if not capture_costs(first):  # vLLM captures, not measured yet: a prompt as plain decoding at batch 1
            estimated["engine_capture_s_per_prompt"] = first["prefill_s"] + args.max_new_tokens / first["decode_tok_s"]
        eval_plan(args, prompts, estimated, spent_s, unmeasured_s=probe_rest_s(args, first))
        raise


def probe_rest_s(args: argparse.Namespace, first: dict) -> float:
    """What the probe still runs after its early check, estimated from what it has timed (an estimate that errs
    long): seven training steps (four stored, three online), each PROBE_STEP_CAPTURES one-pass captures of a prompt
    (where vLLM captures, one prompt decoded at batch 1 stands for one), and its engine child: a start, with the
    capture in vLLM ENGINE_PROBE_PROMPTS prompts as long again each (3.91 s against 3.88 and 3.22 against 4.08 on
    the AVX2 host, 0.41 against 0.73 on the AVX-512 one), and the timed requests, at the project's loop's rate and
    the worst slowdown."""
    capture_s = first.get("capture_s_per_prompt", first["prefill_s"] + args.max_new_tokens / first["decode_tok_s"])
    rest_s = capture_s * (4 * PROBE_STEP_CAPTURES["stored"] + 3 * PROBE_STEP_CAPTURES["online"])
    engine_capture = "capture_s_per_prompt" not in first
    decoding = args.engine != "own" and demo_recipe(args).drafter.init_from is not None
    rest_s += SLOW_VLLM_START_S if engine_capture or decoding else 0.0
    rest_s += ENGINE_PROBE_PROMPTS * capture_s if engine_capture else 0.0
    if decoding:  # each prompt to its natural stop, then each speculator at that length
        request_s = first["prefill_s"] + args.eval_max_new_tokens / first["decode_tok_s"]
        sides = 2 + bool(args.ngram) + bool(args.suffix)
        rest_s += (sides + 1) * SPEC_ENGINE_START_S + ENGINE_DECODE_PROBE_PROMPTS * (
            request_s * (1 + sides * ENGINE_SLOWDOWN) + (sides + 1) * idle_s(default_device()))
    return rest_s


# --- capture and training in the rest --------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace, prompts: Path, rates: dict, spent_s: float) -> dict:
    """Size eval, capture and training to what is left of the budget on this machine.

    The eval comes first (`eval_plan`); capture and training split the remainder CAPTURE_SHARE to the rest: capture
    reads as many prompts as it can generate responses for in its share, training gets a time budget
    (`train.time_budget_s`, at most the recipe's max_steps)."""
    recipe = demo_recipe(args)
    e = eval_plan(args, prompts, rates, spent_s)
    starts, n_eval, n_own, sweep_s, flexible = e["starts"], e["n_eval"], e["n_own"], e["sweep_s"], e["flexible"]
    own_s, heldout_s, recheck_s, eval_kept = e["own_s"], e["heldout_s"], e["recheck_s"], e["eval_kept"]
    lookup_s = e["lookup_s"]
    kept = kept_prompts(prompts, "train", args.capture_limit, args.target, args.max_prompt_tokens)
    measured = "train_online_step_s" in rates or args.hidden_states == "online"
    options = {mode: size_capture_and_training(args, rates, flexible, recipe.train.max_steps, kept, mode)
               for mode in ("stored", "online") if mode == "stored" or measured}
    hidden_states, reason = choose_states(args, rates, recipe.train.micro_batch_size, options)
    chosen = options[hidden_states]
    capture_s, train_s = chosen["capture_s"], flexible - chosen["capture_s"]
    cut = e["cut"]
    return {"spent_s": round(spent_s), "hidden_states": hidden_states, "hidden_states_reason": reason,
            "hidden_states_options": {mode: {k: o[k] for k in ("capture_engine", "capture_kept", "expected_steps")}
                                      for mode, o in options.items()},
            "capture_engine": chosen["capture_engine"], "capture_limit": chosen["capture_limit"],
            "capture_kept": chosen["capture_kept"], "train_budget_s": round(train_s),
            "expected_steps": chosen["expected_steps"], "max_steps": recipe.train.max_steps,
            "eval_limit": read_for(eval_kept, n_eval), "eval_prompts": n_eval, "own_eval_prompts": n_own,
            "sweep_budget_s": round(sweep_s), "fp32_recheck_s": round(recheck_s), "lookup_s": round(lookup_s),
            "ngram": cut["ngram"], "suffix": cut["suffix"], "free_limit": cut["free_limit"],
            "eval_left_out": cut["left_out"],
            "stage_s": {"capture": starts["capture"] + capture_s, "train": starts["train"] + train_s,
                        "capture (held-out)": starts["capture (held-out)"] + n_eval * heldout_s,  # its start in it
                        "eval": starts["eval"] + own_s + sweep_s + recheck_s + lookup_s,
                        "push (dry run)": starts["push (dry run)"]}}


def size_capture_and_training(args: argparse.Namespace, rates: dict, flexible: float, cap: int | None,
                              kept: list[int], hidden_states: str) -> dict:
    """Capture and training in `flexible` seconds: capture reads as many prompts as CAPTURE_SHARE of them (or what
    training at most needs leaves it) captures, through the faster engine, and training gets the rest. Online,
    capture is token-only and every step computes its states (the probe's `train_online_step_s`)."""
    online = hidden_states == "online"
    step_s = rates["train_online_step_s" if online else "train_step_s"]
    costs = capture_costs(rates)
    capture_share_s = CAPTURE_SHARE * flexible
    if cap:  # what training at most needs; the rest of its share goes to capture
        capture_share_s = max(capture_share_s, flexible - cap * step_s)
    engine = faster_capture(costs, capture_share_s, args.capture_engine)
    start_s, per_prompt = costs[engine]
    read = read_for(kept, max(8, int((capture_share_s - start_s) / per_prompt)))
    capture_s = start_s + kept[read - 1] * per_prompt
    steps = int((flexible - capture_s) / step_s)
    return {"capture_engine": engine, "capture_limit": read, "capture_kept": kept[read - 1], "capture_s": capture_s,
            "expected_steps": min(steps, cap) if cap else steps}


def capture_costs(rates: dict) -> dict[str, tuple[float, float]]:
    """The way to capture that the probe measured (`capture_engine`): engine name -> (start-up seconds, seconds per
    prompt); none before the probe has timed it. A token-only capture (`--storage none`) costs about the same: the
    one-pass loop's decode computes the states anyway, and vLLM records them in the forwards that generate."""
    costs = {"own": (0.0, rates["capture_s_per_prompt"])} if "capture_s_per_prompt" in rates else {}
    if "engine_capture_s_per_prompt" in rates:
        costs["vllm"] = (rates["engine_start_s"], rates["engine_capture_s_per_prompt"])
    return costs


def faster_capture(costs: dict[str, tuple[float, float]], seconds: float, allowed: str = "auto") -> str:
    """The capture engine that captures the most prompts in `seconds` at these costs (or `allowed`, if not auto)."""
    if allowed != "auto":
        return allowed
    return max(costs, key=lambda e: (seconds - costs[e][0]) / costs[e][1])


def choose_states(args: argparse.Namespace, rates: dict, micro_batch: int, options: dict[str, dict]) -> tuple[str, str]:
    """("stored" | "online", why): dflash_train.support.measure's rule (`choose_hidden_states`) at the epochs the stored
    plan trains (expected steps x micro batch / prompts kept), on the plans' rates per token: each capture's time
    (start-up included) over the tokens it keeps, each step's over the tokens of its micro batch, at the probe's
    mean sample length; with the disk check where the probe measured the states' size. --hidden-states forces one."""
    import shutil

    from dflash_train.support.measure import choose_hidden_states

    if args.hidden_states != "auto":
        return args.hidden_states, f"--hidden-states {args.hidden_states}"
    if "online" not in options:  # demo_probe.online_step_needed
        return "stored", ("the disk holds the states of every prompt capture may read, and recording them costs "
                          "capture nothing: stored states train faster")
    stored, online = options["stored"], options["online"]
    tokens = rates["capture_mean_tokens"]  # per sample, prompt and response
    per_token = {"capture_states_tok_s": tokens * stored["capture_kept"] / stored["capture_s"],
                 "capture_tokens_tok_s": tokens * online["capture_kept"] / online["capture_s"],
                 "train_stored_tok_s": tokens * micro_batch / rates["train_step_s"],
                 "train_online_tok_s": tokens * micro_batch / rates["train_online_step_s"],
                 "state_bytes_per_token": rates.get("state_bytes_per_token", 0.0)}
    epochs = round(stored["expected_steps"] * micro_batch / stored["capture_kept"], 2)
    disk = shutil.disk_usage(args.workdir).free if "state_bytes_per_token" in rates else None
    return choose_hidden_states(per_token, epochs, round(tokens * stored["capture_kept"]), disk)


def rebudget_training(plan: dict, capture_end_s: float) -> None:
    """Give training what the capture saved against its plan (or take what it overran), so the demo still ends on
    time: the plan sized capture from two batches, and the real ones differ in length and in where they stop."""
    planned_end = plan["spent_s"] + plan["stage_s"]["capture"]
    budget = max(60, round(plan["train_budget_s"] + planned_end - capture_end_s))
    print(f"\n=== plan: capture ended at {capture_end_s:.0f} s ({planned_end:.0f} s planned): training gets "
          f"{budget} s ({plan['train_budget_s']} planned)", flush=True)
    plan["stage_s"]["train"] += budget - plan["train_budget_s"]
    plan["train_budget_s"], plan["capture_end_s"] = budget, round(capture_end_s)


# --- the plan in words -----------------------------------------------------------------------------------------------


def measured_line(rates: dict) -> str:
    """The probe's rates, one line."""
    return (f"measured: compute dtype {rates['precision']}"
            + (f"; one-pass capture {rates['capture_s_per_prompt']:.2f} s per prompt (two whole batches of "
               f"{rates['capture_batch']}, at length quantiles 0.21 and 0.79: "
               f"{' and '.join(f'{t:.2f}' for t in rates.get('capture_s_per_prompt_by_quantile', []))} s)"
               if "capture_s_per_prompt" in rates else "")
            + (f"; a training step of the recipe {rates['train_step_s']:.2f} s" if "train_step_s" in rates else "")
            + (f" ({rates['train_online_step_s']:.2f} s online)" if "train_online_step_s" in rates else "")
            + f"; plain decoding {rates['decode_tok_s']:.1f} tokens/s (batch 1)"
            + (f", {rates['fp32_decode_tok_s']:.1f} in fp32" if "fp32_decode_tok_s" in rates else "")
            + f" after a {rates['prefill_s']:.2f} s prefill of the median prompt"
            + (f"; in vLLM at batch 1 {rates['engine_plain_tok_s']:.1f} tokens/s (whole requests), the starting "
               f"drafter {1 / rates['engine_spec_slowdown']:.2f}x that" if "engine_plain_tok_s" in rates else "")
            + "".join(f", {FREE_NAMES[m]} {1 / x:.2f}x" for m, x in rates.get("engine_free_slowdown", {}).items())
            + (f" (tau walked over the capture sample's answers: "
               + ", ".join(f"{FREE_NAMES[m]} {tau:.2f}" for m, tau in rates["engine_free_tau"].items())
               + f"; a step of theirs {rates['engine_free_step_cost']:.2f} plain steps)"
               if rates.get("engine_free_tau") else "")
            + (f", a verification step {rates['engine_step_cost'][0]:.2f} + {rates['engine_step_cost'][1]:.3f} x K "
               f"plain steps" if "engine_step_cost" in rates else ""))


def print_plan(args, rates: dict, plan: dict, spent_s: float) -> None:
    print(f"\n=== plan for a {args.budget_min:g}-minute demo on this machine ({spent_s:.0f} s spent so far)")
    print(measured_line(rates))
    costs = capture_costs(rates)
    if "vllm" in costs:
        print(f"         capture through vLLM (capture --engine vllm): {costs['vllm'][0]:.0f} s to start, then "
              f"{costs['vllm'][1]:.2f} s per prompt ({ENGINE_PROBE_PROMPTS} prompts generated, their states "
              f"recorded)")
    options = plan["hidden_states_options"]
    print(f"states:  {plan['hidden_states']}: {plan['hidden_states_reason']}; in the budget "
          + ", ".join(f"{mode} {o['capture_kept']} prompts x {o['expected_steps']} steps"
                      for mode, o in options.items()))
    print(f"capture: read {plan['capture_limit']} training prompts, keep the {plan['capture_kept']} of at most "
          f"{args.max_prompt_tokens} tokens, {'through vLLM' if plan['capture_engine'] == 'vllm' else 'one pass'}"
          f"{', token-only' if plan.get('hidden_states') == 'online' else ''} "
          f"(~{plan['stage_s']['capture']:.0f} s)")
    print(f"train:   {plan['train_budget_s']} s of training, about {plan['expected_steps']} steps"
          + (f" (at most {plan['max_steps']})" if plan["max_steps"] else ""))
    print(f"eval:    read {plan['eval_limit']} held-out prompts, keep {plan['eval_prompts']}, "
          f"x {args.eval_max_new_tokens} tokens, engine {args.engine}: vLLM's K sweep {plan['sweep_budget_s']} s, "
          f"the project's loop on the first {plan['own_eval_prompts']}"
          + (f", the fp32 rerun of bf16 mismatches ~{plan['fp32_recheck_s']} s" if plan.get("fp32_recheck_s") else "")
          + (f", {' and '.join(free)} ~{plan['lookup_s']} s" if plan.get("lookup_s") and (free := [
              f"{what} at K = {','.join(map(str, ks))}" for what, ks in (("prompt lookup", plan["ngram"]),
                                                                          ("suffix decoding", plan["suffix"])) if ks]
              + (["the combined speculator"] if args.combined else []))
             else "")
          + f" (~{plan['stage_s']['eval']:.0f} s in all; their capture for the offline "
          f"estimate ~{plan['stage_s']['capture (held-out)']:.0f} s)", flush=True)
    if plan.get("eval_left_out"):
        print(f"         cut to leave capture and training {CAPTURE_AND_TRAIN_SHARE:.0%} of the time: "
              f"{'; '.join(plan['eval_left_out'])}", flush=True)
