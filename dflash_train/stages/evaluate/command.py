"""The eval stage: real speculative decoding with the target on held-out prompts.

    dflash-train eval --drafter runs/x/drafter --target smollm2-135m-instruct --prompts data/prompts/sharegpt \\
        --split eval --out eval/x [--store data/store/heldout] [--baseline-drafter DIR ...]

For every prompt, in one run: plain target decoding (the reference and the tokens/s baseline), then the
speculative loop with the drafter, with each baseline drafter and with block size 1 (no speculation). Every
speculative output is compared with the plain one token by token (the lossless check). Acceptance length
(tau) of a verification step = 1 + the accepted drafts, at most B (spec_decode.Step.tau); a prompt's tau
is the mean over its steps, the reported tau the mean over prompts (and, beside it, over all steps). With
`--store`, the offline estimate runs the trainer's simulated acceptance on captured held-out samples (every
anchor, no target forward) with the same definition, and is reported beside the online tau.

Writes OUT/report.json, OUT/report.md, OUT/acceptance_by_position.png, OUT/tau_histogram.png and
OUT/provenance.json; the folder stays marked incomplete until all of them are written. OUT is claimed for the run
(provenance.OutputClaim): a folder another stage wrote, or one another eval is writing, is refused up front.

Prompts the drafter was trained on are refused (`check_held_out`): they would overstate tau. The drafter's
training_args.json names its training stores; their sample ids (or, where a store is not on this machine, the prompt
set it recorded) are compared with the prompts to evaluate. `--store` is re-hashed (store.check_hashes, cached).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch

from dflash_train import constraints as request_constraints
from dflash_train import sampling
from dflash_train.device import device_problem
from dflash_train.engine import (ENGINE_ARGS_HELP, IDLE_S, LOOKUP_METHODS, SPECULATION_LENGTHS,
                                 engine_args_problem)
from dflash_train.errors import UserError, writing
from dflash_train.options import add_options, at_least, each, from_args, option, validate
from dflash_train.provenance import (OutputClaim, complete_output, read_json, start_output,
                                     write_json_atomic, write_provenance)
from dflash_train.report_tables import constraints_markdown, serving_tables, with_interval
from dflash_train.spec_decode import (DFlashProposer, Generation, NoDraft, Step, TokenChooser, mean_tau,
                                      plain_generate, speculative_generate)
from dflash_train.target import DEFAULT_TARGET, Features, Target, check_fits, load_target, prompt_seed

STAGE = "eval"
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("no report was written (an eval writes its folder only once every run has finished); rerun the same "
               "command to evaluate again")
BOOTSTRAP_RESAMPLES = 2000
PLAIN = "plain (target only)"
NO_SPECULATION = "block size 1"


@dataclass
class EvalConfig:
    """The eval stage's options; the `dflash-train eval` flags are derived from these fields."""
    drafter: str = option(help="drafter folder (as the trainer writes it), e.g. runs/x/drafter")
    prompts: str = option(help="an ingest output folder, or a raw log file")
    out: str = option(help="output folder for the report")
    target: str = option(DEFAULT_TARGET, help="embedded target name, checkpoint folder or hub id")
    split: str = option("eval", help="split of the ingest folder (eval: held out)")
    limit: int | None = option(None, check=at_least(1), help="only the first N prompts (and store samples)")
    max_new_tokens: int = option(256, check=at_least(1), help="tokens generated per prompt")
    max_prompt_tokens: int | None = option(None, check=at_least(1), help="skip (and count) longer prompts, e.g. "
                                           "the limit the training data was captured with")
    temperature: float = option(0.0, check=sampling.flag_check("temperature"), help="0 = greedy")
    seed: int = option(0, help="sampling seed (temperature > 0)")
    block_size: int | None = option(None, check=at_least(2),
                                    help="verify block size (default: the drafter's; at most the drafter's)")
    baseline_drafters: list[str] = option(default_factory=list, flag="--baseline-drafter", metavar="DIR",
                                          help="another drafter folder to put in the same table (repeatable)")
    store: str | None = option(None, help="a capture store of held-out samples for the offline estimate")
    template_kwargs: dict[str, Any] | None = option(None, metavar="JSON", help="chat template options as JSON "
                                                    "(default: the store's, as captured, else none)")
    dtype: Literal["auto", "bf16", "fp32"] = option(
        "auto", help="target and drafter compute dtype (auto: bf16 where the device runs it natively, else fp32); "
                     "in bf16, prompts that differ from plain decoding are rerun in fp32 to tell rounding from errors")
    device: str | None = option(None, help="default: cuda if available, else cpu", check=device_problem)
    threads: int | None = option(None, check=at_least(1), help="torch CPU threads")
    warmup: bool = option(True, help="skip the untimed warm-up run")
    engine: Literal["own", "vllm", "both"] = option(
        "both", help="own: the project's decoding loop; vllm: the vLLM engine (plain and with the drafter as its "
                     "dflash speculator); both: side by side on the same prompts")
    own_limit: int | None = option(None, check=at_least(1), metavar="N",
                                   help="the project's loop decodes only the first N prompts (on a CPU it is ~10x "
                                        "slower than vLLM, which decodes them all)")
    training_prompts: bool = option(False, help="evaluate even prompts the drafter was trained on (an overfit "
                                    "check); the report counts them and push refuses such a report")
    speculative_tokens: list[int] | None = option(
        None, metavar="K,K,...", check=SPECULATION_LENGTHS,
        help="vLLM: the speculation lengths K to time, in this order (default: 1 to B - 1, the most telling "
             "first: the shortest K that keeps tau by the --store's offline estimate, else by the project's loop, "
             "else B - 1; then 1 and the middle of the widest gap); the fastest at batch 1 is best_k")
    sweep_budget_s: float = option(900.0, check=at_least(0), metavar="S",
                                   help="vLLM: seconds for the timed runs; the first K always runs, each next one "
                                        "while the time left holds the most a K has cost")
    concurrency: list[int] = option(default_factory=lambda: [4, 16], metavar="C,C,...", check=each(at_least(2)),
                                    help="vLLM: requests decoded together, timed beside batch 1 for every K "
                                         "(each at least 2)")
    repeats: int = option(1, check=at_least(1), help="vLLM: timed runs per prompt and side (plain, speculative), "
                                                    "alternating which goes first")
    ngram: list[int] = option(default_factory=list, metavar="K,K,...", check=SPECULATION_LENGTHS,
                              help="vLLM: also time the engine's own prompt lookup (method ngram: no model, no "
                                   "training) at these K, the same way, after the drafter's, whatever the budget: "
                                   "the baseline it has to beat (its fastest K at batch 1 is the one compared)")
    suffix: list[int] = option(default_factory=list, metavar="K,K,...", check=SPECULATION_LENGTHS,
                               help="vLLM: also time the engine's suffix decoding (method suffix: drafts from a suffix "
                                    "tree over the prompt and the answers it gave before; no model) at these K, the "
                                    "same way, each K in an engine of its own (needs arctic-inference: make install)")
    engine_args: dict[str, Any] = option(default_factory=dict, metavar="JSON", check=engine_args_problem,
                                         help=ENGINE_ARGS_HELP)


# ------------------------------------------------------------------------------------------------ metrics

def acceptance_stats(step_logs: list[list[Step]], block_size: int) -> dict[str, Any]:
    """tau and per-position acceptance of one method from its per-prompt step logs.

    tau: mean over prompts of the mean step tau within each prompt (prompts that ended on the prefill token
    have no step and do not count); tau_steps: mean over all steps pooled. per_position_acceptance[k-1]: share
    of all steps whose tau - 1 (accepted drafts) is >= k, k = 1..B-1; so tau_steps = 1 + sum of it."""
    per_prompt = [mean_tau(steps) for steps in step_logs if steps]
    taus = [s.tau for steps in step_logs for s in steps]
    return _stats(per_prompt, taus, block_size)


def _stats(per_unit: list[float], taus: list[int], block_size: int) -> dict[str, Any]:
    n = len(taus)
    return {
        "tau": sum(per_unit) / len(per_unit) if per_unit else math.nan,
        "tau_steps": sum(taus) / n if n else math.nan,
        "per_position_acceptance": [sum(t - 1 >= k for t in taus) / n if n else math.nan
                                    for k in range(1, block_size)],
        "tau_histogram": {str(v): sum(t == v for t in taus) for v in range(1, block_size + 1)},
        "num_steps": n,
    }


def bootstrap_interval(statistic: Callable[[list[int]], float | None], n: int, resamples: int = BOOTSTRAP_RESAMPLES,
                       level: float = 0.95, seed: int = 0) -> list[float] | None:
    """The percentile interval (95%) of `statistic` over prompts: `statistic(indices)` of `resamples` resamples of
    the n prompt indices with replacement, seeded; None with fewer than two prompts. Every interval of the report
    (tau, the speedups) is this one."""
    values = sorted(v for v in map(statistic, bootstrap_resamples(n, resamples, seed)) if v is not None
                    and math.isfinite(v))
    if n < 2 or not values:
        return None
    return [values[round((1 - level) / 2 * (len(values) - 1))], values[round((1 + level) / 2 * (len(values) - 1))]]


def bootstrap_resamples(n: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Iterator[list[int]]:
    rng = random.Random(seed)
    for _ in range(resamples):
        yield [rng.randrange(n) for _ in range(n)]


def ratio_of_sums(num: list[float], den: list[float]) -> Callable[[list[int]], float | None]:
    """The statistic sum(num[i]) / sum(den[i]) over the resampled prompts i (tokens/s, a speedup: ratio of sums,
    so that long outputs weigh as much as they cost)."""
    def statistic(idx: list[int]) -> float | None:
        d = sum(den[i] for i in idx)
        return sum(num[i] for i in idx) / d if d > 0 else None
    return statistic


def mean_of(values: list[float | None]) -> Callable[[list[int]], float | None]:
    """The statistic mean(values[i]) over the resampled prompts i that have a value (tau: prompts without a
    verification step do not count)."""
    def statistic(idx: list[int]) -> float | None:
        got = [values[i] for i in idx if values[i] is not None]
        return sum(got) / len(got) if got else None
    return statistic


def offline_estimate(samples, drafter, embed: torch.Tensor, lm_head: torch.Tensor, block_size: int) -> dict[str, Any]:
    """Simulated tau from stored samples, as greedy decoding would take it (the trainer's `simulated_acceptance` at
    every anchor, walked as decoding walks it: objective.decoded_steps), with the same definition as online: per
    sample the mean over its steps, then the mean over samples. tau_by_k[K-1]: the same at speculation length K;
    tau_every_anchor: the mean over every anchor instead, which overstates tau where easy and hard stretches
    alternate (objective.decoded_steps)."""
    from tqdm import tqdm

    from dflash_train.objective import decoded_steps, simulated_acceptance

    per_sample, taus, ids, every_anchor, anchors = [], [], [], [], 0
    by_k: list[list[float]] = [[] for _ in range(1, block_size)]
    for sample in tqdm(samples, desc="offline tau", unit="sample", leave=False):
        lengths = simulated_acceptance(drafter, embed, lm_head, sample, block_size=block_size).tolist()
        if lengths:
            for k, taus_at_k in enumerate(by_k, 1):
                walk = decoded_steps(sample, lengths, block_size, k)
                taus_at_k.append(sum(walk) / len(walk))
            steps = decoded_steps(sample, lengths, block_size)
            per_sample.append(sum(steps) / len(steps))
            taus += steps
            ids.append(sample["id"])
            every_anchor.append(sum(lengths) / len(lengths))
            anchors += len(lengths)
    stats = _stats(per_sample, taus, block_size)
    stats["tau_by_k"] = [sum(t) / len(t) if t else math.nan for t in by_k]
    stats["tau_every_anchor"] = sum(every_anchor) / len(every_anchor) if every_anchor else math.nan
    stats["num_samples"] = len(per_sample)
    stats["num_anchors"] = anchors
    stats["per_sample"] = [{"id": i, "tau": t} for i, t in zip(ids, per_sample)]
    return stats


# ------------------------------------------------------------------------------------------------ checks

def check_drafter_fits(config, target: Target, where: str, block_size: int | None = None) -> None:
    """A drafter (its DFlashConfig) whose target, tapped layers, hidden size or vocabulary do not fit the target:
    one clear error, before any decoding."""
    rows = target.model.get_input_embeddings().weight.shape[0]
    problems = config.target_problems(target.num_layers, rows, set(target.stop_token_ids()))
    if block_size is not None and not 2 <= block_size <= config.block_size:
        problems.append(f"--block-size {block_size} is outside 2..{config.block_size} (block size 1 is always in "
                        f"the table; the drafter was trained to draft blocks of {config.block_size})")
    check_fits(f"drafter {where}", config.features(), f"target {target.name}", target.features(), problems)


def check_store_fits(manifest: dict[str, Any], config, target: Target, where: str) -> None:
    """A held-out store must hold what the drafter reads: this target's states of the drafter's layers."""
    reads = Features(target.identity(), tuple(config.target_layer_ids), config.hidden_size)
    check_fits(f"store {where}", Features.of_store(manifest), "what the drafter reads from this target", reads)


def check_held_out(drafter: str, ids: set[str], what: str, prompt_set: dict[str, Any] | None,
                   allow: bool = False) -> dict[str, Any]:
    """Refuse to evaluate a drafter on prompts it was trained on (they would overstate tau). Its training_args.json
    names its training stores: a store on this machine is compared by id (a sample's id is its prompt's id), one that
    is not by the prompt set it recorded (capture.prompt_set: the same source and split). `ids` and `prompt_set` are
    those of `what` (the prompts, or the --store samples). Returns what was checked, for the report; with `allow`
    (--training-prompts) the overlap is counted there ("training_prompts") instead of refused."""
    from dflash_train.model.checkpoint import folder_file

    args_file = folder_file(Path(drafter), "training_args.json", str(Path(drafter) / "training_args.json"))
    if not args_file.exists():
        return {"checked": False, "why": f"{args_file} does not exist: the training data is unknown"}
    stores = ((read_json(args_file, "the trainer's record of the run").get("data") or {}).get("stores") or [])
    checked: dict[str, Any] = {"checked": True, "by_id": [], "by_prompt_set": [], "not_checked": []}
    for entry in stores:
        path = Path(str(entry.get("path")))
        if (path / "manifest.json").exists():
            from dflash_train.store import open_store

            trained = ids.intersection(open_store(path).ids)
            checked["by_id"].append(str(path))
            if trained and allow:
                checked["training_prompts"] = checked.get("training_prompts", 0) + len(trained)
            elif trained:
                raise UserError(f"{len(trained)} of the {len(ids)} {what} are in the training store {path} of drafter "
                                f"{drafter} (e.g. {', '.join(sorted(trained)[:3])}): tau on training prompts "
                                f"overstates the drafter. Evaluate on held-out prompts (--split eval of the ingest "
                                f"folder it was trained from)")
            continue
        held = entry.get("prompts")
        if isinstance(held, dict) and held.get("source") and prompt_set:
            checked["by_prompt_set"].append(str(path))
            same_split = None in (held.get("split"), prompt_set.get("split")) or held["split"] == prompt_set["split"]
            if held["source"] == prompt_set.get("source") and same_split and allow:
                checked["training_prompts"] = checked.get("training_prompts", 0) + len(ids)
            elif held["source"] == prompt_set.get("source") and same_split:
                raise UserError(f"drafter {drafter} was trained on store {path}, captured from {held['source']} split "
                                f"{held.get('split')!r}: the {what} are training prompts. Evaluate on held-out prompts "
                                f"(--split eval)")
        else:
            checked["not_checked"].append(str(path))
    return checked


# ------------------------------------------------------------------------------------------------ running

@dataclass
class Method:
    """A row of the own-loop table; `role` names what it is, so readers never go by position."""
    name: str
    role: str  # plain | drafter | baseline | no_speculation (ROLES)
    proposer: Any  # None = plain decoding
    drafter_path: str | None = None
    block_size: int = 1
    generations: list[Generation] = field(default_factory=list)


ROLES = ("plain", "drafter", "baseline", "no_speculation")


def by_role(rows: list, role: str) -> list:
    """The rows (Methods, or report["methods"] dicts) of one role, in table order."""
    return [r for r in rows if (r.role if isinstance(r, Method) else r.get("role")) == role]


def _load_proposer(path: str, target: Target, block_size: int | None, dtype: torch.dtype) -> DFlashProposer:
    from dflash_train.model.checkpoint import load_drafter

    drafter, config = load_drafter(path, dtype=dtype, device=target.model.device)
    drafter = drafter.eval().requires_grad_(False)
    check_drafter_fits(config, target, path, block_size)
    head = target.model.get_output_embeddings()
    return DFlashProposer(drafter, target.model.get_input_embeddings(), head, block_size)


def _run_one(method: Method, target: Target, ids: list[int], max_new_tokens: int, chooser: TokenChooser,
             constraints: dict[str, Any] | None = None) -> Generation:
    """One prompt through one method, under its request's constraints (fresh rules: they follow this output)."""
    stop = target.stop_token_ids()
    rules = None
    if constraints:
        rules = request_constraints.Rules(constraints, target.tokenizer, target.config.vocab_size, stop, ids)
        stop = stop + [t for t in constraints.get("stop_token_ids") or [] if t not in stop]
    if method.proposer is None:
        return plain_generate(target.model, ids, max_new_tokens, stop, chooser, rules)
    return speculative_generate(target.model, ids, method.proposer, max_new_tokens, stop, chooser, rules)


@torch.inference_mode()
def diagnose_mismatch(target: Target, ids: list[int], plain: list[int], spec: list[int]) -> dict[str, Any]:
    """Where a speculative output left the plain one: the position, both tokens, and the target's top-2 logit
    margin there (from a forward over the prompt and the common prefix): a margin of a rounding step means a
    near-tie that the block verification and the one-token decode round differently."""
    i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    info: dict[str, Any] = {"index": i, "plain_token": plain[i] if i < len(plain) else None,
                            "spec_token": spec[i] if i < len(spec) else None}
    if i < len(plain) and i < len(spec):
        full = torch.tensor([ids + plain[:i]], device=target.model.device)
        top = target.model(input_ids=full, logits_to_keep=1).logits[0, -1].float().topk(2)
        info["top2_margin"] = float(top.values[0] - top.values[1])
    return info


def recheck_in_fp32(cfg: EvalConfig, device: str, methods: list["Method"], mismatches: list[dict[str, Any]],
                    prompts: dict[str, list[int]], plain_outputs: dict[str, list[int]],
                    constraints: dict[str, dict[str, Any] | None] | None = None) -> None:
    """Rerun every mismatching prompt in fp32, plain and speculative. Records whether they agree there (the
    loop is exact; the low-precision mismatch was rounding) and whether low-precision plain decoding itself
    departs from fp32 plain decoding (it is rounding-dependent too, without any speculation)."""
    target = load_target(cfg.target, dtype=torch.float32, device=device)
    by_name = {m.name: m for m in methods}
    proposers: dict[str, Any] = {}
    for d in mismatches:
        m = by_name[d["method"]]
        if d["method"] not in proposers:
            proposers[d["method"]] = NoDraft() if m.drafter_path is None else \
                _load_proposer(m.drafter_path, target, cfg.block_size, torch.float32)
        ids, c = prompts[d["id"]], (constraints or {}).get(d["id"])
        chooser = TokenChooser(cfg.temperature, prompt_seed(cfg.seed, d["id"]))
        plain = _run_one(Method(PLAIN, "plain", None), target, ids, cfg.max_new_tokens, chooser, c).tokens
        spec = _run_one(Method(d["method"], "drafter", proposers[d["method"]]), target, ids, cfg.max_new_tokens,
                        chooser, c).tokens
        d["fp32_spec_equals_plain"] = spec == plain
        d["plain_equals_fp32_plain"] = plain_outputs[d["id"]] == plain


def load_methods(cfg: EvalConfig, target: Target, dtype: torch.dtype) -> list[Method]:
    """The rows of the table, in order: plain decoding, the drafter, the baseline drafters, block size 1."""
    main = _load_proposer(cfg.drafter, target, cfg.block_size, dtype)
    methods = [Method(PLAIN, "plain", None),
               Method(f"drafter {_label(cfg.drafter)}", "drafter", main, cfg.drafter, main.block_size)]
    for path in cfg.baseline_drafters:
        p = _load_proposer(path, target, cfg.block_size, dtype)
        methods.append(Method(f"baseline {_label(path)}", "baseline", p, path, p.block_size))
    methods.append(Method(NO_SPECULATION, "no_speculation", NoDraft()))
    return methods


def decode_all(methods: list[Method], target: Target, prompts: dict[str, list[int]], cfg: EvalConfig,
               constraints: dict[str, dict[str, Any] | None]):
    """Every method on every prompt, prompt by prompt and in a rotating order (so that load changes on the
    machine hit all methods alike), each speculative output compared with the plain one. Returns the per-prompt rows,
    the mismatch details and the plain outputs of the mismatching prompts."""
    from tqdm import tqdm

    if cfg.warmup:  # first calls pay one-off costs (allocator, kernels): keep them out of the timings
        rid, first = next(iter(prompts.items()))
        for m in methods:
            _run_one(m, target, first, min(8, cfg.max_new_tokens), TokenChooser(cfg.temperature, cfg.seed),
                     constraints.get(rid))
    per_prompt, mismatches, plain_of_mismatching = [], [], {}
    mine = by_role(methods, "drafter")[0].name
    bar = tqdm(prompts.items(), desc="eval", unit="prompt")
    for i, (rid, ids) in enumerate(bar):
        chooser = TokenChooser(cfg.temperature, prompt_seed(cfg.seed, rid))
        order = methods[i % len(methods):] + methods[:i % len(methods)]  # no method always runs first
        outputs = {m.name: _run_one(m, target, ids, cfg.max_new_tokens, chooser, constraints.get(rid)) for m in order}
        for m in methods:
            m.generations.append(outputs[m.name])
        plain = outputs[PLAIN].tokens
        row = {"id": rid, "prompt_tokens": len(ids), "new_tokens": len(plain), "tau": {}, "mismatch": []}
        for m in methods:
            if m.proposer is None:
                continue
            steps = outputs[m.name].steps
            row["tau"][m.name] = mean_tau(steps)
            if outputs[m.name].tokens != plain:
                row["mismatch"].append(m.name)
                mismatches.append({"id": rid, "method": m.name,
                                   **diagnose_mismatch(target, ids, plain, outputs[m.name].tokens)})
                plain_of_mismatching[rid] = plain
        per_prompt.append(row)
        done = [r["tau"][mine] for r in per_prompt if r["tau"][mine] is not None]
        bar.set_postfix(tau=f"{sum(done) / len(done):.2f}" if done else "-")
    return per_prompt, mismatches, plain_of_mismatching


def method_row(m: Method, per_prompt: list[dict[str, Any]], plain: list[Generation]) -> dict[str, Any]:
    row: dict[str, Any] = {"method": m.name, "role": m.role, "drafter": m.drafter_path, "block_size": m.block_size}
    n = len(m.generations)
    if m.proposer is not None:
        row.update(acceptance_stats([g.steps for g in m.generations], m.block_size))
        row["tau_interval"] = bootstrap_interval(mean_of([mean_tau(g.steps) for g in m.generations]), n)
        row["lossless_mismatches"] = sum(m.name in r["mismatch"] for r in per_prompt)
    tokens = sum(g.decode_tokens for g in m.generations)
    forwards = sum(len(g.steps) if m.proposer is not None else g.decode_tokens for g in m.generations)
    row["tokens_per_target_forward"] = tokens / forwards if forwards else math.nan
    row["decode_tokens"] = tokens
    row["decode_s"] = sum(g.decode_s for g in m.generations)
    row["draft_s"] = sum(g.draft_s for g in m.generations)
    plain_tps = _tokens_per_s(plain)
    row["tokens_per_s"] = _tokens_per_s(m.generations)
    row["speedup"] = row["tokens_per_s"] / plain_tps if plain_tps else math.nan
    if m.proposer is not None:
        mine = ratio_of_sums([g.decode_tokens for g in m.generations], [g.decode_s for g in m.generations])
        theirs = ratio_of_sums([g.decode_tokens for g in plain], [g.decode_s for g in plain])
        row["speedup_interval"] = bootstrap_interval(
            lambda idx: a / b if (a := mine(idx)) is not None and (b := theirs(idx)) else None, n)
    return row


def unresolved_in_fp32(mismatches: list[dict[str, Any]], method: str) -> int:
    """The method's mismatches in the project's loop that are not near-ties resolved by the fp32 rerun (a mismatch
    that was not rerun, as in an fp32 eval, stands)."""
    return sum(not d.get("fp32_spec_equals_plain", False) for d in mismatches if d["method"] == method)


def own_loop_eval(cfg: EvalConfig, device: str, methods: list[Method], target: Target,
                  prompts: dict[str, list[int]], dtype: torch.dtype,
                  constraints: dict[str, dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """Every method through the project's own decoding loop, each prompt under its request's `constraints` (by
    id); the headline fields of the report."""
    constraints = constraints or {}
    per_prompt, mismatch_details, plain_of_mismatching = decode_all(methods, target, prompts, cfg, constraints)
    fp32_mismatches = recheck_s = None
    if mismatch_details and dtype != torch.float32:
        t0 = time.perf_counter()
        recheck_in_fp32(cfg, device, methods, mismatch_details, prompts, plain_of_mismatching, constraints)
        recheck_s = time.perf_counter() - t0
        fp32_mismatches = unresolved_in_fp32(mismatch_details, by_role(methods, "drafter")[0].name)
    plain = by_role(methods, "plain")[0].generations
    table = [method_row(m, per_prompt, plain) for m in methods]
    mine = by_role(table, "drafter")[0]
    return {
        "tau": mine["tau"],
        "tau_interval": mine["tau_interval"],
        "tau_steps": mine["tau_steps"],
        "lossless_mismatches": mine["lossless_mismatches"],
        "lossless_checked": len(per_prompt),
        "lossless_mismatches_fp32": fp32_mismatches,  # of those, still different when rerun in fp32
        "lossless_recheck_s": recheck_s,  # the seconds that rerun took (the demo's plan counts it)
        "per_position_acceptance": mine["per_position_acceptance"],
        "tau_histogram": mine["tau_histogram"],
        "tokens_per_s": mine["tokens_per_s"],
        "tokens_per_s_baseline": _tokens_per_s(plain),
        "speedup": mine["speedup"],
        "speedup_interval": mine["speedup_interval"],
        "methods": table,
        "mismatches": mismatch_details,
        "per_prompt": per_prompt,
    }


# ------------------------------------------------------------------------------------------------ the engine

CLOCKS = ("core_s", "decode_s", "wall_s")  # engine core: arrival to last token, first to last token; stopwatch
TIMING = tuple(f"{side}_{clock}" for side in ("plain", "spec") for clock in CLOCKS)
FIGURES = tuple(f"{figure}{clock}" for clock in ("", "_decode", "_wall")
                for figure in ("tokens_per_s", "tokens_per_s_baseline", "speedup"))
HEADLINE = ("tau", "tau_interval", "tau_steps", "per_position_acceptance", "tau_histogram", "num_steps", *FIGURES,
            "speedup_interval", "speedup_decode_interval", "speedup_wall_interval")
TIMING_PROTOCOL = ("warm engines (one short request each first), plain and speculative side by side in one process; "
                   "each prompt decoded alone to its natural stop by plain decoding, then timed plain and speculative "
                   "at that length with ignore_eos (the same number of new tokens on both sides), alternating which "
                   f"side goes first, each request {IDLE_S} s after the last (the idle engine stops polling) with "
                   "both engines' prefix caches emptied (every timed prompt prefilled in full); timed "
                   "by the engine core from the request's arrival to its last token (the decode phase alone: from "
                   "its first token) and by a stopwatch around the whole request; concurrency c: the first c "
                   "prompts (cycled) decoded together, timed the same way")


SWEEP_FIRST_SLACK = 0.01  # the sweep's first K keeps tau within 1% of the whole block's, by the acceptance estimate


def sweep_first_k(tau_by_k: list[float] | None, slack: float = SWEEP_FIRST_SLACK) -> int | None:
    """The shortest speculation length K whose expected tau (tau_by_k[K-1]) is within `slack` of the best: a
    verification step costs no less at a longer K, so by this estimate no longer K is more than `slack` faster.
    None without an estimate."""
    if not tau_by_k or not all(math.isfinite(t) for t in tau_by_k):
        return None
    best = max(tau_by_k)
    return next(k for k, tau in enumerate(tau_by_k, 1) if tau * (1 + slack) >= best)


def tau_by_k_of(acceptance: list[float]) -> list[float]:
    """Expected tau at each K from the acceptance by block position of steps at the whole block (the share of steps
    accepting at least k drafts): 1 + acceptance[0] + ... + acceptance[K-1]."""
    return [1 + sum(acceptance[:k]) for k in range(1, len(acceptance) + 1)]


def k_sweep_order(max_k: int, first: int | None = None) -> list[int]:
    """The speculation lengths 1..max_k in the order the eval times them: `first` (sweep_first_k; default max_k, the
    whole block, what vLLM ran before the sweep), 1, then again and again the geometric middle of the widest gap
    left below `first`; then max_k and the gaps above `first` the same way. A sweep that its budget cuts short has
    timed the likeliest fastest K and spans the range below it."""
    first = max_k if first is None else min(first, max_k)
    order = [first] + ([1] if first > 1 else [])
    for top in (first, max_k):
        order += [top] if top not in order else []
        while len(done := sorted(k for k in order if k <= top)) < top:
            _, _, a, b = max((math.log(b / a), -a, a, b) for a, b in zip(done, done[1:]) if b - a > 1)
            order.append(min(max(round(math.sqrt(a * b)), a + 1), b - 1))
    return order


HOST_DRIFT_LIMIT = 0.15  # plain decoding's own speed may move this much over a sweep before the report says the
#                        machine changed speed while it measured (quiet 2-core hosts: 3-10%; 30% and 72% where a
#                        speedup above 1 at tau 1.26-1.30 proved to be noise: BENCHMARKS.md)


def plain_rates(natural: dict[str, Any], sweep: list[dict[str, Any]]) -> list[float | None]:
    """Plain decoding's decode-phase tokens/s in the reference pass (every prompt to its natural stop, before any
    K) and in each row's timed runs (each K's, then prompt lookup's): the same engine on the same prompts at the
    same lengths, so on a steady machine the same figure; how far they move apart is how far the machine's speed
    moved while the sweep measured."""
    seconds = sum(o.decode_s for o in natural.values())
    reference = sum(len(o.token_ids) - 1 for o in natural.values()) / seconds if seconds > 0 else None
    return [reference, *(row["tokens_per_s_baseline_decode"] for row in sweep)]


def host_drift(rates: list[float | None]) -> float | None:
    """The fastest of plain decoding's rates over the slowest, less 1; None with fewer than two."""
    rates = [r for r in rates if r]
    return max(rates) / min(rates) - 1 if len(rates) > 1 else None


def timing_figures(rows: list[dict[str, Any]], intervals: bool = True) -> dict[str, Any]:
    """Tokens/s of both sides and the speedup over timed runs (`rows`: new_tokens, requests and the mean seconds of
    each side by each clock), by the engine core over the whole request (every new token, prefill included: the
    headline), over the decode phase alone (tokens after each request's first, as the project's loop counts:
    `_decode`) and by the stopwatch (`_wall`); ratios of sums, with bootstrap intervals over the rows."""
    figures: dict[str, Any] = {}
    for suffix, clock in zip(("", "_decode", "_wall"), CLOCKS):
        tokens = [r["new_tokens"] - (r["requests"] if clock == "decode_s" else 0) for r in rows]
        plain, spec = [r[f"plain_{clock}"] for r in rows], [r[f"spec_{clock}"] for r in rows]
        everything = list(range(len(rows)))
        figures[f"tokens_per_s{suffix}"] = ratio_of_sums(tokens, spec)(everything)
        figures[f"tokens_per_s_baseline{suffix}"] = ratio_of_sums(tokens, plain)(everything)
        figures[f"speedup{suffix}"] = ratio_of_sums(plain, spec)(everything)
        if intervals:
            figures[f"speedup{suffix}_interval"] = bootstrap_interval(ratio_of_sums(plain, spec), len(rows))
    return figures


def _mean_times(run: dict[str, Any]) -> dict[str, float]:
    return {key: sum(run[key]) / len(run[key]) for key in TIMING}


def k_row(run: dict[str, Any], natural: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """One speculation length's figures from its timed runs (engine._timed): tau and acceptance by position from
    vLLM's verification steps, tokens/s and speedup by each clock with intervals, the lossless check against the
    plain outputs, and the per-prompt figures."""
    from dflash_train.engine import EngineOutput, engine_steps

    spec = {o["id"]: EngineOutput(**o) for o in run["outputs"]}
    step_logs, per_prompt, unaccounted, spreads = [], [], 0, []
    for timed in run["batch1"]:
        out = spec[timed["id"]]
        steps, left = engine_steps(out, undrafted_steps=run.get("method") in LOOKUP_METHODS)
        step_logs.append(steps)
        unaccounted += left
        times = _mean_times(timed)
        per_prompt.append({"id": timed["id"], "new_tokens": timed["tokens"], "requests": 1, "tau": mean_tau(steps),
                           "mismatch": greedy and out.token_ids != natural[timed["id"]].token_ids, **times,
                           **{f"{side}_cached_tokens": max(timed.get(f"{side}_cached_tokens") or [0])
                              for side in ("plain", "spec")},  # 0: both prefilled every prompt in full
                           **{f"speedup{suffix}": times[f"plain_{clock}"] / times[f"spec_{clock}"]
                              for suffix, clock in zip(("", "_decode", "_wall"), CLOCKS)}})
        spreads += [(max(v) - min(v)) / (sum(v) / len(v)) for key in TIMING if len(v := timed[key]) > 1]
    row = {"k": run["k"], **acceptance_stats(step_logs, run["k"] + 1),
           "tau_interval": bootstrap_interval(mean_of([p["tau"] for p in per_prompt]), len(per_prompt)),
           **timing_figures(per_prompt), "lossless_checked": len(per_prompt) if greedy else 0,
           "lossless_mismatches": sum(p["mismatch"] for p in per_prompt) if greedy else None,
           "tokens_unaccounted_by_steps": unaccounted, "load_s": run["load_s"], "seconds": run["seconds"],
           "repeat_spread": sorted(spreads)[len(spreads) // 2] if spreads else None, "per_prompt": per_prompt}
    return row


def fastest_at_batch_1(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the fastest K at batch 1, by the engine's speedup (a K without a finite one comes last)."""
    return max(rows, key=lambda row: row["speedup"] if math.isfinite(row["speedup"] or math.nan) else -1.0)


def best_k_share(sweep: list[dict[str, Any]], best: int) -> float | None:
    """How often `best` is the fastest K at batch 1 when the prompts are resampled (the bootstrap of the
    intervals): near 1, another set of prompts would pick it too."""
    if len(sweep) < 2:
        return None
    stats = [(row["k"], ratio_of_sums([p["plain_core_s"] for p in row["per_prompt"]],
                                      [p["spec_core_s"] for p in row["per_prompt"]])) for row in sweep]
    n = len(sweep[0]["per_prompt"])
    wins = [max(stats, key=lambda ks: ks[1](idx) or 0.0)[0] == best for idx in bootstrap_resamples(n)]
    return sum(wins) / len(wins)


def concurrency_rows(sweep: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (concurrency, K) measured: batch 1 from the sweep, the others from the concurrency runs."""
    rows = [{"requests": 1, "k": row["k"], **{key: row[key] for key in FIGURES}} for row in sweep]
    for run in runs:
        for timed in run["concurrency"]:
            mean = {"new_tokens": timed["tokens"], "requests": timed["requests"], **_mean_times(timed)}
            rows.append({"requests": timed["requests"], "k": run["k"], **timing_figures([mean], intervals=False)})
    return sorted(rows, key=lambda r: (r["requests"], r["k"]))


def best_per_concurrency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each concurrency, its fastest K (by the engine's speedup) and its figures."""
    best: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row["requests"] not in best or (row["speedup"] or 0) > (best[row["requests"]]["speedup"] or 0):
            best[row["requests"]] = row
    return [best[c] for c in sorted(best)]


def pays_up_to(best: list[dict[str, Any]]) -> int:
    """The largest measured concurrency up to which speculation (at its best K) beats plain decoding at every
    measured concurrency; 0 when it does not even at batch 1."""
    paid = 0
    for row in best:
        if not (row["speedup"] or 0) > 1:
            break
        paid = row["requests"]
    return paid


def per_batch_size_schedule(best: list[dict[str, Any]]) -> list[list[int]] | None:
    """vLLM's `num_speculative_tokens_per_batch_size` (inclusive batch-size ranges and their K; 0 = no drafts)
    from the measured concurrencies: each range runs the K that was fastest at the concurrency it holds (0 where
    plain decoding was faster), split at the geometric middle between measured concurrencies; vLLM carries the
    last K on to larger batches. None when one K serves every measured concurrency (set num_speculative_tokens)
    or speculation loses already at batch 1 (serve without it)."""
    if not best or best[0]["requests"] != 1 or not (best[0]["speedup"] or 0) > 1:
        return None
    ks = [row["k"] if (row["speedup"] or 0) > 1 else 0 for row in best]
    if len(set(ks)) == 1:
        return None
    cs = [row["requests"] for row in best]
    ends = [math.isqrt(a * b) for a, b in zip(cs, cs[1:])] + [cs[-1]]
    schedule: list[list[int]] = []
    for start, end, k in zip([1] + [e + 1 for e in ends], ends, ks):
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = end
        else:
            schedule.append([start, end, k])
    return schedule


FREE_SPECULATORS = {"ngram": ("prompt lookup", "lookup"), "suffix": ("suffix decoding", "suffix")}  # name, log tag


def free_speculator(runs: list[dict[str, Any]], natural: dict[str, Any], greedy: bool
                    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The rows of one of the engine's model-free speculators (prompt lookup, suffix decoding), a row per K timed,
    and its entry: the fastest K at batch 1, with every K's rows at each concurrency (None where none ran)."""
    rows = [k_row(r, natural, greedy) | {"engine_args": r["llm_kwargs"]["speculative_config"]} for r in runs]
    if not rows:
        return rows, None
    best = dict(fastest_at_batch_1(rows))
    best["concurrency"] = concurrency_rows(rows, runs)
    best["pays_up_to_concurrency"] = pays_up_to(best_per_concurrency(best["concurrency"]))
    return rows, best


def ranking(drafter: dict[str, Any], lookup: dict[str, Any] | None, suffix: dict[str, Any] | None
            ) -> list[dict[str, Any]]:
    """The drafter, prompt lookup and suffix decoding at each one's fastest K, fastest first at batch 1 (by the
    engine's speedup over plain decoding on the same prompts), with tau and the intervals: what to serve."""
    rows = [{"speculator": name, "k": row["k"], "tau": row["tau"], "tau_interval": row.get("tau_interval"),
             "speedup": row["speedup"], "speedup_interval": row.get("speedup_interval"),
             "lossless_mismatches": row.get("lossless_mismatches")}
            for name, row in (("drafter", drafter), ("prompt lookup", lookup), ("suffix decoding", suffix)) if row]
    return sorted(rows, key=lambda r: -(r["speedup"] if math.isfinite(r["speedup"] or math.nan) else -1.0))


def engine_eval(cfg: EvalConfig, target: Target, prompts: dict[str, list[int]], block_size: int, dtype_name: str,
                device: str, workdir: Path, expected_tau: tuple[str, list[float]] | None = None,
                constraints: dict[str, dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """What users buy, measured in vLLM: plain decoding and the drafter folder as vLLM's `dflash` speculator at
    each speculation length K (`--speculative-tokens`, else `k_sweep_order` as far as `--sweep-budget-s`
    affords, first the shortest K that keeps the best tau by `expected_tau` (its source, tau at each K):
    sweep_first_k), timed by engine._timed (fixed lengths, warm, interleaved, engine core and stopwatch),
    at batch 1 and at `--concurrency`. Per K: tau and acceptance by position, tokens/s and the speedup by both
    clocks with bootstrap intervals over prompts, the lossless check (greedy: speculative token ids equal plain
    ones, prompt by prompt). The fastest K at batch 1 is best_k: the entry's headline figures (what push's gate and
    the card read) are its own, and its mismatches in a low-precision dtype are rerun in fp32 through the engine.
    Plain decoding's own speed over the sweep (plain_rates) says whether the machine held still while it measured."""
    import os

    from dflash_train import engine
    from dflash_train.model.checkpoint import drafter_identity

    drafter_sha256 = drafter_identity(Path(cfg.drafter))["sha256"]  # the drafter as the engine is about to read it
    source, tau_by_k = expected_tau or (None, None)
    first = None if cfg.speculative_tokens else sweep_first_k(tau_by_k)
    ks = cfg.speculative_tokens or k_sweep_order(block_size - 1, first)
    if too_long := [k for k in ks if k > block_size - 1]:
        raise UserError(f"--speculative-tokens {too_long[0]} is more than the verify block holds (B - 1 = "
                        f"{block_size - 1}: the drafter's block size, or --block-size)")
    stop = target.stop_token_ids()
    max_len = max(len(ids) for ids in prompts.values()) + cfg.max_new_tokens + block_size

    def run(ids: dict[str, list[int]], dtype: str, tag: str, ks: list[int], concurrency: list[int],
            budget_s: float | None, mode: str = "timed") -> tuple[engine.EngineJob, engine.EngineResult]:
        requests = [engine.EngineRequest(id=rid, prompt_token_ids=p, max_tokens=cfg.max_new_tokens,
                                         temperature=cfg.temperature, seed=prompt_seed(cfg.seed, rid),
                                         constraints=(constraints or {}).get(rid))
                    for rid, p in ids.items()]
        job = engine.EngineJob(target=str(target.path), requests=requests, stop_token_ids=stop,
                               dtype=engine.VLLM_DTYPES[dtype], drafter=cfg.drafter, max_model_len=max_len,
                               mode=mode, seed=cfg.seed, device=torch.device(device).type,
                               engine_args=cfg.engine_args, speculative_tokens=ks, concurrency=concurrency,
                               repeats=cfg.repeats, budget_s=budget_s,
                               ngram_tokens=cfg.ngram[0] if cfg.ngram and mode == "timed" else None)
        budget = f", {budget_s:.0f} s budget" if budget_s is not None and len(ks) > 1 else ""
        if first is not None and mode == "timed":
            budget += f"; K = {first} first, the shortest that keeps tau by the {source}"
        if cfg.ngram and mode == "timed":
            budget += f"; then vLLM's prompt lookup at K = {', '.join(map(str, cfg.ngram))}"
        print(f"engine: vLLM, plain and with drafter {cfg.drafter} at K = {', '.join(map(str, ks))} "
              f"({len(requests)} prompts, concurrency 1{''.join(f', {c}' for c in concurrency)}, {dtype}{budget}"
              f"{', the lossless check alone' if mode == 'check' else ''})",
              flush=True)
        return job, engine.run_engine(job, workdir / tag, f"vLLM with drafter {cfg.drafter}")

    job, result = run(prompts, dtype_name, "timed", ks, cfg.concurrency, cfg.sweep_budget_s)
    natural, greedy = result.by_id(), cfg.temperature == 0
    drafted = [r for r in result.timed["runs"] if r.get("method", "dflash") == "dflash"]
    runs = {r["k"]: r for r in drafted}
    sweep = [k_row(r, natural, greedy) for r in drafted]
    free = {"ngram": [r for r in result.timed["runs"] if r.get("method") == "ngram"], "suffix": []}
    seconds = result.load_s + result.wall_s
    # each further lookup K, and each suffix decoding K, in an engine process of its own (EngineJob.ngram_tokens)
    for method, k in [("ngram", k) for k in cfg.ngram[1:]] + [("suffix", k) for k in cfg.suffix]:
        what, tag = FREE_SPECULATORS[method]
        print(f"engine: vLLM, plain and {what} at K = {k} ({len(prompts)} prompts at their lengths above)", flush=True)
        again = engine.run_engine(engine.lookup_job(job, natural, k, method), workdir / f"{tag}-{k}",
                                  f"vLLM with {what} at K = {k}")
        free[method] += again.timed["runs"]
        seconds += again.load_s + again.wall_s
    lookup_rows, lookup = free_speculator(free["ngram"], natural, greedy)
    suffix_rows, suffix = free_speculator(free["suffix"], natural, greedy)
    best = fastest_at_batch_1(sweep)
    best_k = best["k"]
    spec = {o["id"]: o["token_ids"] for o in runs[best_k]["outputs"]}
    mismatches = [{"id": p["id"], **diagnose_mismatch(target, prompts[p["id"]], natural[p["id"]].token_ids,
                                                      spec[p["id"]])}
                  for p in best["per_prompt"] if p["mismatch"]]
    recheck_s = None
    if mismatches and dtype_name != "fp32":
        t0 = time.perf_counter()
        _, again = run({d["id"]: prompts[d["id"]] for d in mismatches}, "fp32", "fp32", [best_k], [], None, "check")
        spec32, plain32 = {o["id"]: o["token_ids"] for o in again.timed["runs"][0]["outputs"]}, again.by_id()
        for d in mismatches:
            d["fp32_spec_equals_plain"] = spec32[d["id"]] == plain32[d["id"]].token_ids
        recheck_s = time.perf_counter() - t0
    table = concurrency_rows(sweep, drafted)
    fastest = best_per_concurrency(table)
    rates = plain_rates(natural, sweep + lookup_rows + suffix_rows)
    return {
        "engine": "vllm",
        "version": result.version,
        "best_k": best_k,
        "num_speculative_tokens": best_k,
        "best_k_share": best_k_share(sweep, best_k),
        **{key: best[key] for key in HEADLINE},
        "lossless_checked": best["lossless_checked"],
        "lossless_mismatches": len(mismatches) if greedy else None,
        "lossless_mismatches_fp32": (sum(not d["fp32_spec_equals_plain"] for d in mismatches)
                                     if mismatches and dtype_name != "fp32" else None),
        "lossless_recheck_s": recheck_s,
        "lossless_note": None if greedy else "not checked: at temperature > 0 vLLM's rejection sampler keeps the "
                                             "target's distribution, not its tokens",
        "mismatches": mismatches,
        "tokens_unaccounted_by_steps": best["tokens_unaccounted_by_steps"],
        "drafter_sha256": drafter_sha256,  # weights and config.json (checkpoint.drafter_identity)
        "dtype": dtype_name,
        "engine_args": runs[best_k]["llm_kwargs"],
        "engine_args_plain": result.llm_kwargs,
        "serve_command": engine.serve_command(runs[best_k]["llm_kwargs"]),
        "load_s": {"plain": result.load_s, "speculative": runs[best_k]["load_s"]},
        "environment": result.environment,
        "sweep": sweep,
        "concurrency": table,
        "concurrency_best": fastest,
        "pays_up_to_concurrency": pays_up_to(fastest),
        "per_batch_size_schedule": per_batch_size_schedule(fastest),
        "ngram": lookup,  # vLLM's prompt lookup at --ngram's fastest K, timed the same way: the baseline (or None)
        "ngram_sweep": lookup_rows,  # every --ngram K's row (batch 1)
        "suffix": suffix,  # vLLM's suffix decoding at --suffix's fastest K, timed the same way (or None)
        "suffix_sweep": suffix_rows,
        "ranking": ranking(best, lookup, suffix),
        "timing": {"protocol": TIMING_PROTOCOL, "repeats": cfg.repeats, "budget_s": cfg.sweep_budget_s,
                   "measured_k": [row["k"] for row in sweep], "skipped_k": result.timed["skipped"],
                   "first_k": None if first is None else {"k": first, "from": source, "slack": SWEEP_FIRST_SLACK},
                   "plain_tokens_per_s_decode": {"reference": rates[0], **{str(r["k"]): v for r, v in
                                                                             zip(sweep, rates[1:])},
                                                 **{f"prompt lookup {r['k']}": v for r, v in
                                                    zip(lookup_rows, rates[1 + len(sweep):])},
                                                 **{f"suffix decoding {r['k']}": v for r, v in
                                                    zip(suffix_rows, rates[1 + len(sweep) + len(lookup_rows):])}},
                   "host_drift": (drift := host_drift(rates)), "host_drift_limit": HOST_DRIFT_LIMIT,
                   "host_unsteady": drift is not None and drift > HOST_DRIFT_LIMIT,
                   "concurrency": [1, *cfg.concurrency], "seconds": seconds,
                   "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "per_prompt": best["per_prompt"],
    }


def own_engine_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The project's loop in the shape of an engine entry, for the side-by-side table."""
    keys = ("tau", "tau_interval", "tau_steps", "per_position_acceptance", "tau_histogram", "num_steps",
            "tokens_per_s", "tokens_per_s_baseline", "speedup", "speedup_interval", "lossless_checked",
            "lossless_mismatches", "lossless_mismatches_fp32")
    mine = by_role(report["methods"], "drafter")[0]
    return {"engine": "own", **{k: report.get(k, mine.get(k)) for k in keys}, "num_steps": mine.get("num_steps")}


def evaluate(cfg: EvalConfig, workdir: Path | None = None) -> dict[str, Any]:
    """Run the eval; `workdir` holds the engine runs (jobs and logs) when the engine takes part."""
    from dflash_train.stages.capture.command import load_prompt_records
    from dflash_train.device import default_device, machine, resolve_precision
    from dflash_train.model.checkpoint import check_finished

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    validate(cfg)
    for path in [cfg.drafter, *cfg.baseline_drafters]:
        check_finished(path)
    own, in_engine = cfg.engine in ("own", "both"), cfg.engine in ("vllm", "both")
    if (cfg.engine_args or cfg.suffix) and not in_engine:
        raise UserError(f"{'--engine-args' if cfg.engine_args else '--suffix'} configures vLLM, and --engine "
                        f"{cfg.engine} does not run it: pass --engine vllm or both")
    if in_engine:
        from dflash_train.engine import check_vllm, suffix_problem

        check_vllm()  # before anything is loaded: a missing engine is one line, not a late failure
        if cfg.suffix and (problem := suffix_problem()):
            raise UserError(f"--suffix: {problem}")
    records, _ = load_prompt_records(cfg.prompts, cfg.split, cfg.limit)
    from dflash_train.stages.capture.command import prompt_set

    held_out = {"prompts": check_held_out(cfg.drafter, {r.id for r in records},
                                          f"prompts to evaluate ({cfg.prompts}, split {cfg.split!r})",
                                          prompt_set(cfg.prompts, cfg.split, None), cfg.training_prompts)}
    device = cfg.device or default_device()
    where = machine(device)  # before anything runs: its load average says what else ran
    precision = resolve_precision(cfg.dtype, device)
    print(f"eval: compute dtype {precision.describe()}", flush=True)
    dtype_name, dtype = precision.name, precision.dtype
    target = load_target(cfg.target, dtype=dtype, device=device)
    methods = load_methods(cfg, target, dtype)
    mine = by_role(methods, "drafter")[0]
    main, B = mine.proposer, mine.block_size

    store, template_kwargs = None, cfg.template_kwargs
    if cfg.store:
        store, held_out["store"] = open_eval_store(cfg, target)
        if template_kwargs is None:
            template_kwargs = (store.manifest.get("generation") or {}).get("template_kwargs") or {}
    template_kwargs = template_kwargs or {}

    prompts = {r.id: target.render(r.messages, r.tools, **template_kwargs) for r in records}
    too_long = [rid for rid, ids in prompts.items() if cfg.max_prompt_tokens and len(ids) > cfg.max_prompt_tokens]
    for rid in too_long:
        del prompts[rid]
    if not prompts:
        raise UserError(f"all {len(too_long)} prompts of {cfg.prompts} (split {cfg.split!r}) are longer than "
                        f"--max-prompt-tokens {cfg.max_prompt_tokens}: nothing to evaluate")
    constraints, constrained = eval_constraints([r for r in records if r.id in prompts], cfg, own)
    report: dict[str, Any] = {
        "tau": None, "tau_interval": None, "tau_steps": None, "tau_offline": None, "tau_gap": None,
        "lossless_mismatches": None, "lossless_checked": 0, "lossless_mismatches_fp32": None,
        "per_position_acceptance": None, "tau_histogram": None, "tokens_per_s": None, "tokens_per_s_baseline": None,
        "speedup": None, "speedup_interval": None,
        "block_size": B, "methods": [], "mismatches": [], "offline": None, "per_prompt": [], "engines": {},
        "settings": {**asdict(cfg), "template_kwargs": template_kwargs, "device": str(device),
                     "dtype": dtype_name, "dtype_reason": precision.reason, "block_size": B,
                     "num_prompts": len(prompts), "skipped_long_prompts": len(too_long), "constraints": constrained,
                     "threads": torch.get_num_threads(), "machine": where,
                     "sampling": "greedy" if cfg.temperature == 0 else
                     f"temperature {cfg.temperature}, Gumbel-max noise keyed on (seed, prompt id, position)"},
        "drafter": _drafter_summary(cfg.drafter, main),
        "baseline_drafters": [_drafter_summary(m.drafter_path, m.proposer) for m in by_role(methods, "baseline")],
        "target": target.identity().to_dict(),
        "held_out_check": held_out,
    }
    if store is not None:
        n = len(store) if cfg.limit is None else min(cfg.limit, len(store))
        offline = offline_estimate((store[i] for i in range(n)), main.drafter,
                                   target.model.get_input_embeddings().weight,
                                   target.model.get_output_embeddings().weight, B)
        offline["store"] = str(cfg.store)
        offline["samples_of_eval_prompts"] = sum(r["id"] in prompts for r in offline["per_sample"])
        report["offline"] = offline
        report["tau_offline"] = offline["tau"]
    if own:
        own_prompts = dict(list(prompts.items())[:cfg.own_limit])
        report["settings"]["own_prompts"] = len(own_prompts)
        report.update(own_loop_eval(cfg, device, methods, target, own_prompts, dtype, constraints))
        report["engines"]["own"] = own_engine_summary(report)
    if in_engine:
        if workdir is None:
            raise ValueError("evaluate(..., workdir) is needed when the engine takes part")
        expected_tau = (("offline estimate", report["offline"]["tau_by_k"]) if report["offline"] else
                        ("project's loop", tau_by_k_of(report["per_position_acceptance"])) if own else None)
        report["engines"]["vllm"] = engine_eval(cfg, target, prompts, B, dtype_name, device, Path(workdir),
                                                expected_tau, constraints)
    if report["offline"]:
        online = report["tau"] if report["tau"] is not None else report["engines"]["vllm"]["tau"]
        offline_tau = report["offline"]["tau"]
        report["tau_gap"] = online - offline_tau if online is not None and offline_tau is not None else None
    return report


def eval_constraints(records: list, cfg: EvalConfig, own: bool
                     ) -> tuple[dict[str, dict[str, Any] | None], dict[str, Any]]:
    """Each prompt's constraints as the eval decodes it (plain and speculative alike), and what the report says of
    them: how many prompts were constrained, by kind, and how many were decoded without a setting vLLM refuses with
    speculative decoding (min_p, logit_bias: left out on both sides, never silently). The eval samples by its own
    --temperature and --seed, so a request's seed and n are not used."""
    by_id: dict[str, dict[str, Any] | None] = {}
    kinds: dict[str, int] = {}
    without = {key: 0 for key in request_constraints.NOT_WITH_SPECULATION}
    for r in records:
        for key in without:
            without[key] += key in (r.constraints or {})
        c = request_constraints.without(r.constraints, request_constraints.NOT_WITH_SPECULATION + ("seed", "n"))
        if own:
            try:
                request_constraints.check_replayable(c, cfg.temperature == 0, f"prompt {r.id}")
            except ValueError as err:
                raise UserError(str(err)) from None
        by_id[r.id] = c
        kind = request_constraints.kind(c)
        kinds[kind] = kinds.get(kind, 0) + 1
    constrained = sum(n for kind, n in kinds.items() if kind != "none")
    return by_id, {"constrained": constrained, "of": len(records), "by_kind": kinds, "decoded_without": without}


def open_eval_store(cfg: EvalConfig, target: Target):
    """The --store of the offline estimate, its shards re-hashed, checked to hold no training sample and to hold
    what the drafter reads from this target; returns (store, its held-out check for the report)."""
    from dflash_train.model.checkpoint import read_config
    from dflash_train.store import check_hashes, holds_states, open_store

    check_hashes(cfg.store)
    store = open_store(cfg.store)
    if not holds_states(store.manifest):
        raise UserError(f"--store {cfg.store} is a token-only store (captured with --storage none): the offline "
                        "estimate reads the target's hidden states; capture the held-out prompts with states")
    held_out = check_held_out(cfg.drafter, set(store.ids), f"samples of --store {cfg.store}",
                              store.manifest.get("prompts"), cfg.training_prompts)
    check_store_fits(store.manifest, read_config(cfg.drafter), target, cfg.store)
    return store, held_out


def _label(path: str) -> str:
    """runs/smollm2-demo/drafter -> smollm2-demo/drafter: short, and tells drafters of different runs apart."""
    parts = Path(path).resolve().parts
    return "/".join(parts[-2:])


def _tokens_per_s(generations: list[Generation]) -> float:
    seconds = sum(g.decode_s for g in generations)
    return sum(g.decode_tokens for g in generations) / seconds if seconds > 0 else math.nan


def _drafter_summary(path: str, proposer: DFlashProposer) -> dict[str, Any]:
    """The drafter the report measured: its shape, and what decides its outputs (checkpoint.drafter_identity:
    sha256, weights_sha256 and config), which push holds the folder it releases against."""
    from dflash_train.model.checkpoint import drafter_identity, read_config

    cfg = read_config(path)
    return {"path": str(path), "block_size": cfg.block_size, "num_hidden_layers": cfg.num_hidden_layers,
            "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
            "num_parameters": sum(p.numel() for p in proposer.drafter.parameters()),
            **drafter_identity(Path(path)), "made_for_target": (cfg.target or {}).get("name")}


# ------------------------------------------------------------------------------------------------ report

def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    skipped = f" ({s['skipped_long_prompts']} longer than {s['max_prompt_tokens']} tokens skipped)" \
        if s.get("skipped_long_prompts") else ""
    lines = [f"# Eval: drafter {_label(s['drafter'])} on target {report['target']['name']}", "",
             f"{s['num_prompts']} prompts from `{s['prompts']}` (split {s['split']}){skipped}, up to "
             f"{s['max_new_tokens']} new tokens, {s['sampling']}, {s['dtype']} on {s['device']} "
             f"({s['threads']} threads), block size {report['block_size']}."
             + (f" The project's loop decoded the first {s['own_prompts']} of them (--own-limit)."
                if s.get("own_prompts", s["num_prompts"]) < s["num_prompts"] else ""), ""]
    lines += constraints_markdown(s.get("constraints"))
    lines += _engines_markdown(report)
    if report["methods"]:
        lines += _own_loop_markdown(report)
    if report["offline"]:
        o = report["offline"]
        lines += [f"Offline estimate (`{o['store']}`, {o['num_samples']} samples, {o['samples_of_eval_prompts']} "
                  f"of them of the prompts above; {o['num_anchors']} anchors, no target forward): tau "
                  f"{_fmt(o['tau'])} as greedy decoding walks the answers (the mean over every anchor: "
                  f"{_fmt(o['tau_every_anchor'])}); online - offline = "
                  f"{_fmt(report['tau_gap'])}.", ""]
    lines += _acceptance_markdown(report)
    lines += ["", "tau = 1 + accepted drafts (at most B), per verification step; "
              "tokens/s of the decode phase count the tokens after the first (prefill excluded), of a whole "
              "request every new token; speedup = tokens/s over plain decoding's on the same prompts in the same "
              "run.", ""]
    return "\n".join(lines)


# (label, the project's loop's key, vLLM's key, digits): the same quantity in both columns, or "-" where one has none
ENGINE_ROWS = (("tau (mean over prompts) [95% interval]", "tau", "tau", 2),
               ("tau (all steps)", "tau_steps", "tau_steps", 2), ("verification steps", "num_steps", "num_steps", 0),
               ("tokens/s plain / speculative, decode phase", "tokens_per_s", "tokens_per_s_decode", 1),
               ("speedup, decode phase [95%]", "speedup", "speedup_decode", 2),
               ("tokens/s plain / speculative, whole request (engine)", None, "tokens_per_s", 1),
               ("speedup, whole request (engine) [95%]", None, "speedup", 2),
               ("tokens/s plain / speculative, whole request (stopwatch)", None, "tokens_per_s_wall", 1),
               ("speedup, whole request (stopwatch) [95%]", None, "speedup_wall", 2),
               ("lossless mismatches", "lossless_mismatches", "lossless_mismatches", 0))


def _engines_markdown(report: dict[str, Any]) -> list[str]:
    """The engine and the project's loop side by side, and what each counts; vLLM's K sweep and concurrency."""
    engines = report.get("engines") or {}
    if not engines.get("vllm"):
        return []
    names = {"own": "project's loop (transformers)", "vllm": f"vLLM {engines['vllm'].get('version')}"
             + (f", K = {engines['vllm']['best_k']}" if engines["vllm"].get("best_k") else "")}
    cols = [k for k in ("own", "vllm") if engines.get(k)]
    lines = ["## The drafter in the engine and in the project's loop", "",
             "| | " + " | ".join(names[c] for c in cols) + " |", "|---" * (1 + len(cols)) + "|"]
    for label, own_key, vllm_key, digits in ENGINE_ROWS:
        cells = []
        for c in cols:
            key = own_key if c == "own" else vllm_key
            value = engines[c].get(key) if key else None
            if value is None:
                cells.append("-")
            elif key.startswith("lossless"):
                cells.append(f"{value} of {engines[c].get('lossless_checked')}")
            elif key.startswith("tokens_per_s"):
                baseline = engines[c].get(key.replace("tokens_per_s", "tokens_per_s_baseline", 1))
                cells.append(f"{_fmt(baseline, digits)} / {_fmt(value, digits)}")
            elif f"{key}_interval" in engines[c] or key == "tau":
                cells.append(with_interval(value, engines[c].get(f"{key}_interval")))
            else:
                cells.append(_fmt(float(value) if isinstance(value, int) and digits else value, digits))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for k in range(1, min(4, report["block_size"])):
        cells = [_fmt(_at(engines[c].get("per_position_acceptance") or [], k - 1), 3) for c in cols]
        lines.append(f"| acceptance at position {k} | " + " | ".join(cells) + " |")
    v = engines["vllm"]
    lines += ["", "Both decode the same token ids (the project renders the chat template once), greedy, batch 1. "
              "The project's loop: transformers target + the drafter module, tau from its own verification steps, "
              "tokens/s from its own clock around the decode phase. vLLM: its own DFlash implementation loading the "
              "drafter folder as shipped, tau from its per-request speculative-decoding metrics (accepted drafts per "
              "verification step) with the same definition; tokens/s from the engine core's timestamps (the whole "
              "request from its arrival, or the decode phase from its first token) and by a stopwatch around each "
              "whole request.", ""]
    tables = serving_tables(v, report["settings"].get("machine"))
    lines += tables + [""] if tables else []
    lines += [f"vLLM command: `{v.get('serve_command')}`", ""]
    if v.get("lossless_note"):
        lines += [f"vLLM lossless check {v['lossless_note']}.", ""]
    for d in v.get("mismatches") or []:
        line = (f"- vLLM, {d['id']}: first difference at new token {d['index']}: plain {d['plain_token']}, "
                f"speculative {d['spec_token']}, top-2 logit margin {_fmt(d.get('top2_margin'), 4)}")
        if "fp32_spec_equals_plain" in d:
            line += f"; rerun in fp32: speculative {'equals' if d['fp32_spec_equals_plain'] else 'differs from'} plain"
        lines.append(line)
    if v.get("tokens_unaccounted_by_steps"):
        lines.append(f"Warning: {v['tokens_unaccounted_by_steps']} output tokens are not accounted for by vLLM's "
                     f"verification steps (decode steps without drafts).")
    return lines + [""]


def _own_loop_markdown(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    lines = ["## The project's decoding loop", "",
             "| method | block | tau (mean over prompts) | tau (all steps) | tokens/target forward | tokens/s | "
             "speedup | drafting share of decode time | lossless mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["methods"]:
        lines.append(f"| {row['method']} | {row['block_size']} | {_fmt(row.get('tau'))} | "
                     f"{_fmt(row.get('tau_steps'))} | {_fmt(row['tokens_per_target_forward'])} | "
                     f"{_fmt(row['tokens_per_s'], 1)} | {_fmt(row['speedup'])}x | "
                     f"{_fmt(row['draft_s'] / row['decode_s'] if row['decode_s'] and row['draft_s'] else None)} | "
                     f"{row.get('lossless_mismatches', '-')} |")
    lines.append("")
    mismatches = report["lossless_mismatches"]
    lines.append(f"Lossless check: {mismatches} of {report['lossless_checked']} prompts differ from plain decoding "
                 f"for the drafter.")
    for d in report["mismatches"]:
        line = (f"- {d['id']} ({d['method']}): first difference at new token {d['index']}: plain "
                f"{d['plain_token']}, speculative {d['spec_token']}, top-2 logit margin "
                f"{_fmt(d.get('top2_margin'), 4)}")
        if "fp32_spec_equals_plain" in d:
            same = {True: "equals", False: "differs from"}
            line += (f"; rerun in fp32: speculative {same[d['fp32_spec_equals_plain']]} plain; {s['dtype']} plain "
                     f"decoding {same[d['plain_equals_fp32_plain']]} fp32 plain decoding")
        lines.append(line)
    if report.get("lossless_mismatches_fp32") == 0:
        lines.append(f"Rerun in fp32, all of these prompts match: the {s['dtype']} differences are near-ties that "
                     f"the block verification and the one-token decode round differently, not a decoding error.")
    elif report.get("lossless_mismatches_fp32"):
        lines.append(f"Rerun in fp32, {report['lossless_mismatches_fp32']} of these prompts still differ: "
                     f"a decoding error, not rounding.")
    return lines + [""]


def _acceptance_markdown(report: dict[str, Any]) -> list[str]:
    """Acceptance by block position: every drafter of the project's loop, vLLM, and the offline estimate."""
    columns = [(r["method"], r["per_position_acceptance"]) for r in report["methods"] if r["block_size"] > 1]
    if (report.get("engines") or {}).get("vllm"):
        drafter = by_role(report["methods"], "drafter")
        columns.append((f"vLLM: {drafter[0]['method'] if drafter else 'drafter'}",
                        report["engines"]["vllm"]["per_position_acceptance"]))
    if report["offline"]:
        columns.append(("offline", report["offline"]["per_position_acceptance"]))
    lines = ["Acceptance by block position (share of steps accepting at least k drafts):", "",
             "| k | " + " | ".join(name for name, _ in columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for k in range(1, report["block_size"]):
        lines.append(f"| {k} | " + " | ".join(_fmt(_at(values or [], k - 1), 3) for _, values in columns) + " |")
    return lines


def _at(values: list[float], i: int) -> float | None:
    return values[i] if i < len(values) else None


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["methods"] if r.get("tau") is not None and r["block_size"] > 1]
    engine = (report.get("engines") or {}).get("vllm")
    if engine and engine.get("tau") is not None:
        rows.append({"method": f"vLLM {engine['version']}" + (f", K = {engine['best_k']}" if engine.get("best_k")
                                                               else ""), "tau": engine["tau"],
                     "block_size": len(engine["per_position_acceptance"]) + 1,
                     "per_position_acceptance": engine["per_position_acceptance"],
                     "tau_histogram": engine["tau_histogram"]})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        ks = list(range(1, r["block_size"]))
        ax.plot(ks, r["per_position_acceptance"], marker="o", label=f"{r['method']} (tau {_fmt(r['tau'])})")
    if report["offline"]:
        o = report["offline"]
        ax.plot(range(1, report["block_size"]), o["per_position_acceptance"], linestyle="--", marker="x",
                label=f"offline estimate (tau {_fmt(o['tau'])})")
    ax.set(xlabel="block position k", ylabel="share of steps accepting >= k drafts", ylim=(0, 1.02),
           title="Acceptance by block position")
    ax.set_xticks(range(1, report["block_size"]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    position_png = out / "acceptance_by_position.png"
    fig.savefig(position_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    B = report["block_size"]
    width = 0.8 / max(1, len(rows) + bool(report["offline"]))
    series = [(r["method"], r["tau_histogram"]) for r in rows]
    if report["offline"]:
        series.append(("offline estimate", report["offline"]["tau_histogram"]))
    for i, (name, hist) in enumerate(series):
        total = sum(hist.values()) or 1
        xs = [v + (i - (len(series) - 1) / 2) * width for v in range(1, B + 1)]
        ax.bar(xs, [hist.get(str(v), 0) / total for v in range(1, B + 1)], width=width, label=name)
    ax.set(xlabel="tau (acceptance length of a verification step)", ylabel="share of steps", title="tau histogram")
    ax.set_xticks(range(1, B + 1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    hist_png = out / "tau_histogram.png"
    fig.savefig(hist_png, dpi=120)
    plt.close(fig)
    return [position_png, hist_png]


def _finite(x: Any) -> Any:
    """NaN (a metric over nothing, e.g. no steps) -> None: report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_report(report: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "report.json", _finite(report))
    (out / "report.md").write_text(markdown(report))
    plot(report, out)


# ------------------------------------------------------------------------------------------------ CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, EvalConfig)


def is_eval_folder(folder: Path) -> bool:
    """An eval's output from before folders recorded their stage: its report.json holds a tau and the settings (a
    report.json alone may be anyone's)."""
    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"tau", "settings"} <= report.keys()


def run(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    cfg = from_args(EvalConfig, args)
    out = Path(cfg.out)
    # claimed first: a folder that is not an eval's, or that another eval is writing, is refused before minutes of
    # decoding; a run that fails leaves no folder behind when it created it
    with OutputClaim(out, STAGE, legacy=is_eval_folder):
        # engine runs (jobs, logs) go to a scratch folder, removed when the eval ends: kept only when the error's
        # line names an engine log in it (engine.run_engine's "full log: PATH"), for the failure report
        workdir = Path(tempfile.mkdtemp(prefix="dflash-eval-engine-"))
        keep = False
        try:
            report = evaluate(cfg, workdir)  # all checks and decoding first: a bad input leaves no half-written folder
            with writing(out):
                start_output(out, STAGE)
                write_report(report, out)
                if report["engines"].get("vllm"):
                    logs = out / "engine"
                    logs.mkdir(exist_ok=True)
                    for log in sorted(workdir.glob("*/engine.log")):
                        shutil.copyfile(log, logs / f"{log.parent.name}.log")
                write_provenance(out, config=asdict(cfg), stage=STAGE, drafter=report["drafter"],
                                 target=report["target"])
                complete_output(out)
        except UserError as err:
            keep = str(workdir) in str(err)
            raise
        finally:
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
    print(markdown(report))
    print(f"eval report: {out / 'report.json'}, {out / 'report.md'}, {out / 'acceptance_by_position.png'}, "
          f"{out / 'tau_histogram.png'}")
    return 0
