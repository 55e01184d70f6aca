"""The capture stage's options: `CaptureConfig` (the `dflash-train capture` flags are derived from its fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dflash_train import sampling
from dflash_train.device import device_problem
from dflash_train.engine.args import ENGINE_ARGS_HELP, engine_args_problem
from dflash_train.options import at_least, in_range, option
from dflash_train.store.writer import DEFAULT_SHARD_BYTES
from dflash_train.target import DEFAULT_TARGET, TemplateKwargs


@dataclass
class CaptureConfig:
    """The capture stage's options; the `dflash-train capture` flags are derived from these fields."""
    prompts: str = option(help="an ingest output folder, or a raw log file")
    out: str = option(help="store folder to write (rerun the same command to resume)")
    target: str = option(DEFAULT_TARGET, help="embedded target name, checkpoint folder or hub id")
    split: str = option("train", help="split of the ingest folder")
    layers: list[int] | None = option(None, metavar="IDS", help="tapped decoder layer ids, e.g. 1,9,17 (strictly "
                                      "increasing, as engines concatenate them); wins over --num-taps")
    num_taps: int = option(5, aliases=("--num-layers",), check=at_least(1),
                           help="tap n layers evenly spaced from 1 to L-3, or layer L // 2 for n = 1 (not the "
                                "drafter's num_layers; --num-layers is the old spelling)")
    max_new_tokens: int = option(256, check=at_least(1), help="response cap, tokens (a logged request's own "
                                                              "max_tokens wins where it is smaller)")
    max_prompt_tokens: int = option(4096, check=at_least(1),
                                    help="skip (and count) prompts longer than this; they are never truncated")
    batch_size: int = option(8, check=at_least(1), help="prompts decoded together")
    temperature: float | None = option(None, check=sampling.flag_check("temperature"),
                                       help="sampling temperature for every prompt (default: the logged "
                                            "request's, else greedy)")
    top_p: float | None = option(None, check=sampling.flag_check("top_p"),
                                 help="nucleus sampling (default: the logged request's)")
    seed: int = option(0, help="sampling seed (per prompt: a hash of seed and prompt id)")
    limit: int | None = option(None, check=at_least(1), help="only the first N prompts of the split")
    storage: Literal["bf16", "fp8", "none"] = option(
        "bf16", help="storage dtype of the tapped states; none: a token-only store (ids, loss mask, weights, top-k; "
                     "about 5 bytes per token), whose states training computes (data.hidden_states: online)")
    responses: Literal["generate", "logged"] = option("generate", help="the target's own responses, or the logged "
                                                                       "ones (one prefill)")
    constraints: Literal["replay", "ignore"] = option(
        "replay", help="replay: decode each request under its own constraints as production did (structured "
                       "outputs, stop, penalties, ...: `dflash_train.constraints`); ignore: without them (only to "
                       "measure what replaying them is worth)")
    shard_size_mb: float = option(DEFAULT_SHARD_BYTES / 2**20, check=in_range(0, 1e6, low_open=True),
                                  help="shard size in MiB")
    template_kwargs: TemplateKwargs = option(default_factory=dict, metavar="JSON",
                                             help='chat template options as JSON, e.g. \'{"enable_thinking": false}\'')
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", help="the target's compute dtype (auto: bf16 where the device runs it natively, else fp32); the "
                     "storage dtype is --storage")
    engine: Literal["own", "vllm"] = option(
        "own", help="own: transformers generates and records the states in one pass; vllm: vLLM generates the "
                    "responses (continuous batching) and records the states and top-k in the same forwards")
    device: str | None = option(None, help="default: cuda (this rank's GPU) if available, else cpu",
                                check=device_problem)
    device_map: str | None = option(None, help="e.g. auto: spread a large target over the GPUs")
    threads: int | None = option(None, check=at_least(1), help="torch CPU threads per process")
    store_topk: int = option(0, check=at_least(0), metavar="K",
                             help="also store the target's top-K token log-probs per position, soft labels for "
                                  "objective.soft_label_weight (6*K bytes per token; 0 = off)")
    engine_args: dict[str, Any] = option(default_factory=dict, metavar="JSON", check=engine_args_problem,
                                         help=f"--engine vllm: {ENGINE_ARGS_HELP}")
