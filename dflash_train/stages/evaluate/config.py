"""The eval stage's options (`dflash-train eval` flags): what every part of the eval reads, from the command down to
the project's loop and the engine sweep."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from dflash_train import sampling
from dflash_train.device import device_problem
from dflash_train.engine.args import ENGINE_ARGS_HELP, SPECULATION_LENGTHS, engine_args_problem
from dflash_train.options import at_least, each, option
from dflash_train.spec_decode.lookup import SUFFIX_SCORE, CombinedRule, combined_problem
from dflash_train.target import DEFAULT_TARGET


def step_cost_problem(value: list[float] | None) -> str | None:
    """--step-cost's check: two finite numbers, A > 0 and B >= 0."""
    if value is None:
        return None
    if len(value) != 2 or not all(math.isfinite(x) for x in value) or value[0] <= 0 or value[1] < 0:
        return "must be two numbers A,B with A > 0 and B >= 0 (a step at K costs A + B x K plain steps)"
    return None


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
                                          help="another drafter folder to put in the same table (repeatable: the "
                                               "project's loop takes several; vLLM times one, beside the "
                                               "drafter's first K, paired by prompt)")
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
             "first: the shortest K that keeps tau by the --store's offline estimate, else B - 1; then 1 and the "
             "middle of the widest gap); the fastest at batch 1 is best_k")
    sweep_budget_s: float = option(900.0, check=at_least(0), metavar="S",
                                   help="vLLM: seconds for the timed runs; the first K always runs, each next one "
                                        "while the time left holds the most a K has cost")
    step_cost: list[float] | None = option(
        None, metavar="A,B", check=step_cost_problem,
        help="vLLM: a verification step at K costs A + B x K plain decoding steps on this machine (scripts/demo.py's "
             "probe measures it); the sweep then starts at the K of the best expected tau over that cost (the "
             "shortest within a percent of it) instead of the shortest that keeps tau")
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
    free_limit: int | None = option(None, check=at_least(1), metavar="N",
                                    help="vLLM: time prompt lookup, suffix decoding and the combined speculator on "
                                         "the first N prompts only (the drafter on all; the ranking compares every "
                                         "speculator on the prompts all of them decoded): a shorter eval")
    combined: str | None = option(None, metavar="RULE", check=combined_problem,
                                  help="vLLM: also time the combined speculator (this package's vLLM plugin: the "
                                       "suffix tree's block where its score reaches the rule's suffix, else prompt "
                                       "lookup's where lookup matched and the drafter's first draft is less likely "
                                       "than the rule's confidence, at confidence 1 wherever lookup matched, else "
                                       "the drafter's; a step whose blocks need no drafter skips its pass) at the "
                                       "longest of the drafter's, the rule's k and suffix decoding's fastest K, "
                                       "the same way; RULE like "
                                       f"{CombinedRule(suffix=SUFFIX_SCORE).setting()!r}, or 'on': confidence "
                                       f"{CombinedRule().confidence:g} where the drafter's tau beats lookup's "
                                       f"(--ngram), else 1, and suffix {SUFFIX_SCORE:g} where arctic-inference "
                                       "loads")
    engine_args: dict[str, Any] = option(default_factory=dict, metavar="JSON", check=engine_args_problem,
                                         help=ENGINE_ARGS_HELP)
