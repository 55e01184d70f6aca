"""What a stage hands the engine and what it gets back: the job (`EngineJob`: a target, optionally a drafter, the
requests, the mode) and its requests (`EngineRequest`, with the vLLM sampling parameters each one decodes under:
`sampling_params`), the `vllm.LLM` arguments of a job (`EngineJob.llm_kwargs`, its KV-cache size:
`kv_cache_bytes_for`); then the result (`EngineResult`, its `EngineOutput`s) and how a stage reads an output: why it
ended (`ending`) and its verification steps (`engine_steps`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_train.spec_decode.lookup import PROMPT_LOOKUP

VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the project's dtype names -> vLLM's
LOOKUP_METHODS = ("ngram", "suffix")  # the engine's own model-free speculators, timed beside the drafter
FREE_NAMES = {"ngram": "prompt lookup", "suffix": "suffix decoding", "combined": "the combined speculator",
              "baseline": "the baseline drafter"}  # EngineJob.free's methods in words
# EngineJob.free's methods that are drafters (the drafter at another K, the baseline drafter): timed on every prompt
# (never cut by free_limit), and their seconds count against the K sweep's budget, the model-free speculators' do not
DRAFTERS = ("dflash", "baseline")
GiB = 1 << 30
# The KV-cache block of a job that records states on CPU (vLLM's CPU attention takes multiples of 32; its default is
# 128). The prefix cache serves whole blocks only, so a request's tail re-run (`taps.tail_id`) computes its last
# partial block again: 58 positions an answer at 128 on the router log, 18 at 32; and shared system prompts are
# served from the cache at 32 where 128 served none there (BENCHMARKS.md "Capture's states from vLLM's forwards").
STATES_BLOCK_SIZE_CPU = 32


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
    # a second DFlash drafter folder, timed beside the drafter where `free` names it ("baseline"): the one it is
    # compared with (eval --baseline-drafter: the one serving now)
    baseline_drafter: str | None = None
    max_model_len: int = 2048
    mode: str = "batch"  # batch: all requests at once (capture) | timed: the eval's speedup protocol
    #                      (`child._timed`) | check: the lossless check alone (`child._check`)
    seed: int = 0
    device: str = "cpu"
    # batch mode: append every finished output to this JSONL file as it is generated, so a killed run keeps what
    # it generated (capture resumes from it)
    stream_to: str | None = None
    # batch mode: the tapped states of these layers and/or the top-k log-probs recorded from the engine's own
    # forwards into one file per request in this folder (`taps`), each written before its response is streamed
    states_to: str | None = None
    state_layers: list[int] = field(default_factory=list)
    state_topk: int = 0
    kv_cache_bytes: int | None = None  # None: sized from the job (see `kv_cache_bytes_for`)
    engine_args: dict[str, Any] = field(default_factory=dict)  # the user's, over the job's (args.engine_args_problem)
    # timed mode: the speculation lengths K to measure (the first always, each next one while `budget_s`, counted
    # from the child's start, affords it), the concurrencies timed beside batch 1, timed runs per prompt and side
    speculative_tokens: list[int] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)
    repeats: int = 1
    budget_s: float | None = None
    # timed mode: the free speculators timed beside the drafter's first K, sharing plain decoding's runs, whatever
    # the budget (a baseline asked for is measured): (method, K) each, "ngram" vLLM's prompt lookup
    # (lookup.PROMPT_LOOKUP), "suffix" its suffix decoding, "combined" the drafter with the combined speculator's
    # block where `combined` picks it (spec_decode.combined), "dflash" the drafter at another K (the demo's probe
    # times two K on the same plain runs), or "baseline" the baseline drafter (eval: at the drafter's first K)
    free: list[tuple[str, int]] = field(default_factory=list)
    # a lookup.CombinedRule setting: the combined speculator's, in timed mode ("combined" in `free`) and check mode
    combined: str | None = None
    free_limit: int | None = None  # timed mode: the free speculators (not the DRAFTERS) time only the first N prompts
    # timed mode: requests decoded first, all at once on the plain engine as a capture decodes them (continuous
    # batching), untimed but for their wall time: the demo's probe measures capture and decoding in one child
    capture_sample: list[EngineRequest] = field(default_factory=list)

    def max_num_seqs(self, plain: bool = False) -> int | None:
        """timed, check: the largest concurrency (one engine serves batch 1 and every concurrency), the plain
        engine's at least the capture sample's size; batch: vLLM's."""
        if self.mode == "batch":
            return None
        return max([1, *self.concurrency, *([len(self.capture_sample)] if plain else [])])

    def llm_kwargs(self, k: int | None = None, method: str = "dflash") -> dict[str, Any]:
        """The `vllm.LLM(...)` arguments (the same names as `vllm serve` flags) of plain decoding, or with the
        drafter as vLLM's dflash speculator proposing `k` tokens per step (method "ngram": vLLM's prompt lookup
        instead; "suffix": its suffix decoding; "baseline": dflash's with the baseline drafter; "combined": dflash's,
        the plugin turned on by the environment); the user's engine arguments last. The plain engine records states
        where the job asks (`states_to`: capture, the probe's sample)."""
        records = bool(self.states_to) and not k
        kwargs: dict[str, Any] = {"model": str(self.target), "dtype": self.dtype, "max_model_len": self.max_model_len,
                                  # eager where states are recorded: the hooks (`taps`) see no compiled graph
                                  "seed": self.seed, "enforce_eager": self.device == "cpu" or records,
                                  "max_num_seqs": self.max_num_seqs(plain=not k)}
        if k and method == "ngram":
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, **PROMPT_LOOKUP}
        elif k and method == "suffix":
            kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
        elif k:
            drafter = self.baseline_drafter if method == "baseline" else self.drafter
            kwargs["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
        if records and self.device == "cpu" and self.mode == "batch":  # a timed job's engines keep vLLM's block,
            kwargs["block_size"] = STATES_BLOCK_SIZE_CPU                 # the eval's (the probe's sample errs slow)
        if not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & self.engine_args.keys():
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes or kv_cache_bytes_for(self, plain=not k)
        return {**{key: value for key, value in kwargs.items() if value is not None}, **self.engine_args}


def kv_cache_bytes_for(job: EngineJob, plain: bool = False) -> int:
    """KV-cache memory for a job: a timed job needs its largest concurrency of sequences of max_model_len in the
    target's and the drafter's layers (the larger drafter's, with a baseline drafter: an engine holds one of them; twice
    that, for vLLM's block rounding), its plain engine room for the capture sample too; a batch run gets 2 GiB, which
    keeps a SmolLM2-sized target decoding dozens of sequences at once. Sizing it to the job matters on CPU: vLLM
    allocates and touches the whole cache at start (2 GiB took about 10 s here)."""
    if job.mode == "batch":
        return 2 * GiB
    per_token = _kv_bytes_per_token(job.target) + max(
        [_kv_bytes_per_token(folder) for folder in (job.drafter, job.baseline_drafter) if folder], default=0)
    k = max([*job.speculative_tokens, *(k for _, k in job.free)], default=0)
    return max(64 << 20, 2 * per_token * job.max_num_seqs(plain) * (job.max_model_len + 2 * k + 32))


def _kv_bytes_per_token(folder: str) -> int:
    """The KV cache a checkpoint folder's layers take per token: K and V, up to 4 bytes each."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4


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


def free_job(job: EngineJob, natural: dict[str, EngineOutput], free: list[tuple[str, int]]) -> EngineJob:
    """The free speculators `free` ((method, K) each, as EngineJob.free) timed after the timed `job`, in a process of
    their own: the same prompts at the lengths the job's reference pass found (`natural`, by id; a prompt it refused
    has none and is left out), no drafter K."""
    return replace(job, requests=[at_length(r, len(natural[r.id].token_ids)) for r in job.requests if r.id in natural],
                   speculative_tokens=[], free=free, budget_s=None)


@dataclass
class EngineOutput:
    id: str
    token_ids: list[int]
    finish_reason: str | None
    decode_s: float  # engine-core time from the first to the last generated token
    stop_reason: Any = None  # vLLM's: None (its EOS), the stop token id or the stop string that ended it
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verification step (speculative only)
    drafted: list[int] = field(default_factory=list)  # drafts proposed per verification step
    sources: dict[str, dict[str, int]] | None = None  # combined speculator's blocks by source (spec_decode.combined)
    suffix_answers_before: int | None = None  # the answers its suffix tree held before this request (ditto)


@dataclass
class EngineResult:
    version: str
    llm_kwargs: dict[str, Any]
    load_s: float
    wall_s: float  # generation only, all requests
    outputs: list[EngineOutput]  # timed mode: plain decoding to each prompt's natural stop
    environment: dict[str, str]
    timed: dict[str, Any] | None = None  # timed mode: per K, the timings and speculative outputs (`child._timed`)
    refused: dict[str, str] = field(default_factory=dict)  # the requests the engine refused: id -> why (one line)
    capture_sample: list[EngineOutput] = field(default_factory=list)  # timed mode: the capture sample's outputs
    capture_sample_s: float = 0.0  # and the seconds they took together

    def by_id(self) -> dict[str, EngineOutput]:
        return {o.id: o for o in self.outputs}


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


def engine_steps(output: EngineOutput, undrafted_steps: bool = False) -> tuple[list, int]:
    """The verification steps of one speculative request as `spec_decode.loop.Step`s, and how many output tokens no
    step accounts for (should be 0).

    The prefill gives the first token; verification step i commits its accepted drafts plus the target's own
    next token, except where the output ends (stop token or max_tokens), where the last step's committed count
    is what remains of the output. Its tau still counts every draft vLLM accepted before the cut, as vLLM itself,
    the reference DFlash loop and `Step.tau` do.

    vLLM records no step where the speculator drafted nothing (prompt lookup without a match: a plain decoding
    step). With `undrafted_steps`, each token no recorded step accounts for is such a step (accepted 0, committed
    1), so that tau stays tokens per target forward; a DFlash drafter drafts at every step."""
    from dflash_train.spec_decode.loop import Step

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
