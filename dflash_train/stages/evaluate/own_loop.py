"""The project's own decoding loop (spec_decode.loop) on the eval's prompts: plain target decoding (the reference and
the tokens/s baseline), the drafter, each baseline drafter and block size 1, prompt by prompt; every speculative output
compared with the plain one token by token (the lossless check), mismatches in a low-precision dtype rerun in fp32 to
tell rounding from errors. One row per method (`Method`); the report's `own` (eval_report.OwnLoop), its headline
the drafter's row."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dflash_train import constraints as request_constraints
from dflash_train.eval_report import MethodRow, Mismatch, OwnLoop, OwnPrompt, fields_of
from dflash_train.spec_decode.loop import (DFlashProposer, Generation, NoDraft, TokenChooser, mean_tau, plain_generate,
                                           speculative_generate)
from dflash_train.stages.evaluate.config import EvalConfig
from dflash_train.stages.evaluate.metrics import acceptance_stats, bootstrap_interval, ratio_of_sums
from dflash_train.target import Target, check_fits, load_target, prompt_seed
from dflash_train.report_tables import by_role

PLAIN = "plain (target only)"
NO_SPECULATION = "block size 1"


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


def check_drafter_fits(config, target: Target, where: str, block_size: int | None = None) -> None:
    """A drafter (its DFlashConfig) whose target, tapped layers, hidden size or vocabulary do not fit the target:
    one clear error, before any decoding."""
    rows = target.model.get_input_embeddings().weight.shape[0]
    problems = config.target_problems(target.num_layers, rows, set(target.stop_token_ids()))
    if block_size is not None and not 2 <= block_size <= config.block_size:
        problems.append(f"--block-size {block_size} is outside 2..{config.block_size} (block size 1 is always in "
                        f"the table; the drafter was trained to draft blocks of {config.block_size})")
    check_fits(f"drafter {where}", config.features(), f"target {target.name}", target.features(), problems)


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
def diagnose_mismatch(target: Target, ids: list[int], plain: list[int], spec: list[int], rid: str,
                      method: str | None = None) -> Mismatch:
    """Where a speculative output left the plain one: the position, both tokens, and the target's top-2 logit
    margin there (from a forward over the prompt and the common prefix): a margin of a rounding step means a
    near-tie that the block verification and the one-token decode round differently. `rid`: the prompt's id;
    `method`: whose output (the project's loop)."""
    i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    found = Mismatch(id=rid, index=i, plain_token=plain[i] if i < len(plain) else None,
                     spec_token=spec[i] if i < len(spec) else None, method=method)
    if i < len(plain) and i < len(spec):
        full = torch.tensor([ids + plain[:i]], device=target.model.device)
        top = target.model(input_ids=full, logits_to_keep=1).logits[0, -1].float().topk(2)
        found.top2_margin = float(top.values[0] - top.values[1])
    return found


def recheck_in_fp32(cfg: EvalConfig, device: str, methods: list["Method"], mismatches: list[Mismatch],
                    prompts: dict[str, list[int]], plain_outputs: dict[str, list[int]],
                    constraints: dict[str, dict[str, Any] | None] | None = None) -> None:
    """Rerun every mismatching prompt in fp32, plain and speculative. Records whether they agree there (the
    loop is exact; the low-precision mismatch was rounding) and whether low-precision plain decoding itself
    departs from fp32 plain decoding (it is rounding-dependent too, without any speculation)."""
    target = load_target(cfg.target, dtype=torch.float32, device=device)
    by_name = {m.name: m for m in methods}
    proposers: dict[str, Any] = {}
    for d in mismatches:
        m = by_name[d.method]
        if d.method not in proposers:
            proposers[d.method] = NoDraft() if m.drafter_path is None else \
                _load_proposer(m.drafter_path, target, cfg.block_size, torch.float32)
        ids, c = prompts[d.id], (constraints or {}).get(d.id)
        chooser = TokenChooser(cfg.temperature, prompt_seed(cfg.seed, d.id))
        plain = _run_one(Method(PLAIN, "plain", None), target, ids, cfg.max_new_tokens, chooser, c).tokens
        spec = _run_one(Method(d.method, "drafter", proposers[d.method]), target, ids, cfg.max_new_tokens,
                        chooser, c).tokens
        d.fp32_spec_equals_plain = spec == plain
        d.plain_equals_fp32_plain = plain_outputs[d.id] == plain


def load_methods(cfg: EvalConfig, target: Target, dtype: torch.dtype) -> list[Method]:
    """The rows of the table, in order: plain decoding, the drafter, the baseline drafters, block size 1."""
    main = _load_proposer(cfg.drafter, target, cfg.block_size, dtype)
    methods = [Method(PLAIN, "plain", None),
               Method(f"drafter {drafter_label(cfg.drafter)}", "drafter", main, cfg.drafter, main.block_size)]
    for path in cfg.baseline_drafters:
        p = _load_proposer(path, target, cfg.block_size, dtype)
        methods.append(Method(f"baseline {drafter_label(path)}", "baseline", p, path, p.block_size))
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
        speculative = [m for m in methods if m.proposer is not None]
        differ = [m.name for m in speculative if outputs[m.name].tokens != plain]
        per_prompt.append(OwnPrompt(id=rid, prompt_tokens=len(ids), new_tokens=len(plain), mismatch=differ,
                                    tau={m.name: mean_tau(outputs[m.name].steps) for m in speculative}))
        for name in differ:
            mismatches.append(diagnose_mismatch(target, ids, plain, outputs[name].tokens, rid, name))
            plain_of_mismatching[rid] = plain
        done = [r.tau[mine] for r in per_prompt if r.tau[mine] is not None]
        bar.set_postfix(tau=f"{sum(done) / len(done):.2f}" if done else "-")
    return per_prompt, mismatches, plain_of_mismatching


def method_row(m: Method, per_prompt: list[OwnPrompt], plain: list[Generation]) -> MethodRow:
    tokens = sum(g.decode_tokens for g in m.generations)
    forwards = sum(len(g.steps) if m.proposer is not None else g.decode_tokens for g in m.generations)
    plain_tps, tokens_per_s = _tokens_per_s(plain), _tokens_per_s(m.generations)
    row = MethodRow(method=m.name, role=m.role, drafter=m.drafter_path, block_size=m.block_size,
                    tokens_per_target_forward=tokens / forwards if forwards else math.nan, decode_tokens=tokens,
                    decode_s=sum(g.decode_s for g in m.generations), draft_s=sum(g.draft_s for g in m.generations),
                    tokens_per_s=tokens_per_s, speedup=tokens_per_s / plain_tps if plain_tps else math.nan)
    if m.proposer is None:
        return row
    mine = ratio_of_sums([g.decode_tokens for g in m.generations], [g.decode_s for g in m.generations])
    theirs = ratio_of_sums([g.decode_tokens for g in plain], [g.decode_s for g in plain])
    interval = bootstrap_interval(lambda idx: a / b if (a := mine(idx)) is not None and (b := theirs(idx)) else None,
                                  len(m.generations))
    return replace(row, **fields_of(acceptance_stats([g.steps for g in m.generations], m.block_size)),
                   lossless_mismatches=sum(m.name in r.mismatch for r in per_prompt), speedup_interval=interval)


def unresolved_in_fp32(mismatches: list[Mismatch], method: str) -> int:
    """The method's mismatches in the project's loop that are not near-ties resolved by the fp32 rerun (a mismatch
    that was not rerun, as in an fp32 eval, stands)."""
    return sum(not d.fp32_spec_equals_plain for d in mismatches if d.method == method)


def own_loop_eval(cfg: EvalConfig, device: str, methods: list[Method], target: Target,
                  prompts: dict[str, list[int]], dtype: torch.dtype,
                  constraints: dict[str, dict[str, Any] | None] | None = None) -> OwnLoop:
    """Every method through the project's own decoding loop, each prompt under its request's `constraints` (by
    id): the report's `own`, its headline the drafter's row."""
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
    (mine,) = by_role(table, "drafter")
    return OwnLoop(**fields_of(mine.acceptance()), lossless_checked=len(per_prompt),
                   lossless_mismatches=mine.lossless_mismatches, lossless_mismatches_fp32=fp32_mismatches,
                   lossless_recheck_s=recheck_s, mismatches=mismatch_details, tokens_per_s=mine.tokens_per_s,
                   tokens_per_s_baseline=_tokens_per_s(plain), speedup=mine.speedup,
                   speedup_interval=mine.speedup_interval, methods=table, per_prompt=per_prompt)


def drafter_label(path: str) -> str:
    """runs/smollm2-demo/drafter -> smollm2-demo/drafter: short, and tells drafters of different runs apart."""
    parts = Path(path).resolve().parts
    return "/".join(parts[-2:])


def _tokens_per_s(generations: list[Generation]) -> float:
    seconds = sum(g.decode_s for g in generations)
    return sum(g.decode_tokens for g in generations) / seconds if seconds > 0 else math.nan
