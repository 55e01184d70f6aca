"""What the user may pass to the engine, and the command line that serves as the engine ran.

The user's own engine arguments (`--engine-args '{"tensor_parallel_size": 8}'`) go on top of the job's
(`jobs.EngineJob.llm_kwargs`), checked first against the keys the project passes through, each with its type and
range (ENGINE_ARGS, `engine_args_problem`). `serve_command` writes the `vllm serve` line equivalent to an engine's
arguments, for the report and the model card.
"""

from __future__ import annotations

import importlib
import json
import shlex
from typing import Any

from dflash_train.engine import install
from dflash_train.options import Check, at_least, each, in_range, integer_at_least, one_of

SPECULATION_LENGTHS = each(at_least(1))  # the check of a list of K (--speculative-tokens, --ngram): each K once

# Engine arguments the project sets from its own flags; --engine-args may not set them.
RESERVED_ENGINE_ARGS = {"model": "--target", "dtype": "--dtype", "seed": "--seed",
                        "max_model_len": "--max-new-tokens: it is the longest prompt plus the answer cap",
                        "speculative_config": "--drafter (eval: --speculative-tokens)",
                        "disable_log_stats": "nothing (the eval reads the engine's statistics)"}


def _switch(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _vllm_choices(module: str, name: str) -> Check:
    """A check that the value is one of the names of vLLM's own Literal `module.name` (imported when a value is
    checked: importing vLLM takes seconds)."""
    def check(value: Any) -> str | None:
        install.check_vllm()
        import typing

        return one_of(*typing.get_args(getattr(importlib.import_module(module), name)))(value)
    return check


# The vLLM engine arguments --engine-args passes (`vllm.LLM` keyword names, the `vllm serve` flags with _ for -),
# each with its type and range: vLLM 0.32's own, from its config classes (the class named), where they state one.
# They choose how the engine spreads, sizes and schedules its work, never what it decodes or which code it runs:
# every other key is refused, among them those that load code (trust_remote_code, the *_cls class paths, plugins)
# or name files and folders (tokenizer, download_dir, ...), which would let a JSON argument run or read anything.
ENGINE_ARGS: dict[str, Check] = {
    "tensor_parallel_size": integer_at_least(1),  # ParallelConfig: ge=1
    "pipeline_parallel_size": integer_at_least(1),  # ParallelConfig: ge=1
    "data_parallel_size": integer_at_least(1),  # ParallelConfig: ge=1
    "gpu_memory_utilization": in_range(0, 1, low_open=True),  # CacheConfig: gt=0, le=1
    "kv_cache_memory_bytes": integer_at_least(1),  # CacheConfig: int, no bound stated (a size: at least 1 byte)
    "block_size": integer_at_least(1),  # CacheConfig: gt=0
    "kv_cache_dtype": _vllm_choices("vllm.config.cache", "CacheDType"),  # CacheConfig.cache_dtype
    "enable_prefix_caching": _switch,  # CacheConfig
    "max_num_seqs": integer_at_least(1),  # SchedulerConfig: ge=1
    "max_num_batched_tokens": integer_at_least(1),  # SchedulerConfig: ge=1
    "enable_chunked_prefill": _switch,  # SchedulerConfig
    "enforce_eager": _switch,  # ModelConfig
    "quantization": _vllm_choices("vllm.model_executor.layers.quantization", "QuantizationMethods"),  # ModelConfig
}

ENGINE_ARGS_HELP = ('vLLM engine arguments as JSON, e.g. \'{"tensor_parallel_size": 8}\' (vllm serve\'s flags, '
                    '_ for -): parallelism, memory, scheduling and quantization only, each in its range (README: '
                    'Engine arguments)')


def engine_args_problem(args: dict[str, Any] | None) -> str | None:
    """What is wrong with the user's vLLM engine arguments (`--engine-args` JSON: `vllm.LLM` keyword names such as
    tensor_parallel_size), or None: a key dflash-train sets itself, a key not in ENGINE_ARGS (the nearest one that
    is named), or a value of the wrong type or out of its range. The option check of `--engine-args` (capture and
    eval): `options.validate` makes it one line naming the flag and the key, before any engine starts and before
    any output folder is made."""
    import difflib

    for key, value in (args or {}).items():
        if key in RESERVED_ENGINE_ARGS:
            return f"sets {key!r}, which dflash-train sets itself (use {RESERVED_ENGINE_ARGS[key]})"
        if key not in ENGINE_ARGS:
            near = difflib.get_close_matches(key, list(ENGINE_ARGS), n=1)
            return (f"has {key!r}, which dflash-train does not pass to vLLM"
                    + (f" (did you mean {near[0]!r}?)" if near else
                       f": it passes {', '.join(ENGINE_ARGS)}, never a key that loads code or names a file"))
        if value is None:
            return f"has {key}=null: leave the key out for vLLM's default"
        if problem := ENGINE_ARGS[key](value):
            return f"has {key}={json.dumps(value)}, which {problem}"
    return None


def serve_command(kwargs: dict[str, Any], model: str | None = None, drafter: str | None = None) -> str:
    """The `vllm serve` command line equivalent to LLM(**kwargs); `model`/`drafter` replace the local paths (a
    card names Hub repos, never a local folder)."""
    args = ["vllm", "serve", model or kwargs["model"]]
    for key, value in kwargs.items():
        if key == "model" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "speculative_config":
            value = dict(value, model=drafter or value["model"])
            args += [flag, json.dumps(value, separators=(",", ":"))]
        elif value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return shlex.join(args)
