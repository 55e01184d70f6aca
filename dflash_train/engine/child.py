"""What runs inside the engine's child process (`python -m dflash_train.engine.child JOB_DIR`, started by
`runner.run_engine`): read the job, decode it in vLLM, write result.json atomically.

Three modes. `batch` (capture): every request at once, continuous batching. `timed` (eval): the speedup protocol,
`_timed` below: plain decoding and one speculative engine per speculation length K, alive side by side in the
child, each warmed up; every prompt decoded first to its natural stop (the reference outputs and lengths), then
timed plain and speculative at that fixed length (`ignore_eos`: both sides decode the same number of tokens),
alternating which goes first, at batch 1 and at the requested concurrencies; each run timed twice, by the engine
core's timestamps (request arrival, first and last token) and by a stopwatch around the call. `check` (the eval's
fp32 rerun of its mismatches): each prompt alone, plain and speculative at one K (the drafter, or the combined
speculator with `lookup_method` "combined"), once each to its natural stop, untimed. Acceptance comes from vLLM's
per-request speculative-decoding metrics (the accepted drafts of every verification step). The prompts are token
ids rendered by the project (`target.render`), so the engine and the project's loop decode the very same prompts.
A request the engine refuses when it is added (vLLM validates its sampling parameters and compiles its grammar
there) is left out in every mode, the others decoded: result.json's `refused` names each with its reason
(`refusal`); timed and check first screen every request on each engine they open at the start (`_screened`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from dflash_train.engine.install import engine_environment_keys, vllm_version
from dflash_train.engine.jobs import EngineJob, EngineOutput, EngineRequest, at_length, sampling_params
from dflash_train.engine.runner import JOB_FILE, RESULT_FILE
from dflash_train.spec_decode.combined import source_counts, suffix_answers
from dflash_train.spec_decode.lookup import COMBINED_SETTING, CombinedRule, parse_combined

# A vLLM worker process keeps polling its message queue for 1 s after its last request (shm_broadcast's busy loop):
# where the workers are processes of their own (a GPU), the timed protocol waits this long before each timed request,
# so that the other engine's worker is asleep.
IDLE_S = 1.2


def idle_s(device: str) -> float:
    """The wait before each timed request on `device`: IDLE_S, none on CPU, where the engine and its worker run in
    the child (`install.engine_environment`) and nothing polls (the wait was 45% of a free speculator's timed K
    there; without it the speedups agree: BENCHMARKS "How the eval times speculative decoding")."""
    return 0.0 if device == "cpu" else IDLE_S


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STREAM_EVERY_S = 10.0


def _stop_with_the_stage() -> None:
    """The engine belongs to the stage that started it: when that process dies (killed, or its terminal closed),
    the kernel sends this one SIGTERM (PR_SET_PDEATHSIG), which exits through Python so that vLLM's own shutdown
    stops its engine-core and worker processes, instead of leaving them decoding for nobody."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the stage died before the request took effect
            sys.exit(128 + signal.SIGTERM)


def vllm_sampling_params(request: EngineRequest, stop_token_ids: list[int]) -> Any:
    """`vllm.SamplingParams` of one request (jobs.sampling_params), its structured outputs built as vLLM's own."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = sampling_params(request, stop_token_ids)
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def refusal(err: BaseException) -> str:
    """Why the engine refused a request, in one line: the exception's class and its message's first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:500]


def refused_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a request it refuses: its validation errors (a grammar it cannot compile among them,
    `VLLMValidationError`), pydantic's and its own ValueErrors and TypeErrors of a setting."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, VLLMClientError)


def _screened(engines: list[Any], requests: list[EngineRequest], params: Callable[[EngineRequest], Any]
              ) -> tuple[list[EngineRequest], dict[str, str]]:
    """The requests every engine of `engines` takes, and those one refuses (id: `refusal`): each is added to each
    engine and, taken, aborted at once, before anything is decoded."""
    refused: dict[str, str] = {}
    for llm in engines:
        for r in requests:
            if r.id in refused:
                continue
            try:
                added = llm.llm_engine.add_request(f"screen-{r.id}", {"prompt_token_ids": r.prompt_token_ids},
                                                   params(r))
            except refused_errors() as err:
                refused[r.id] = refusal(err)
                continue
            llm.llm_engine.abort_request([added], internal=True)
    return [r for r in requests if r.id not in refused], refused


def _child(workdir: Path) -> None:
    """Runs inside the engine process: decode the job's requests, write result.json atomically."""
    _stop_with_the_stage()
    started = time.perf_counter()
    job_raw = json.loads((workdir / JOB_FILE).read_text())
    job = EngineJob(**{**job_raw, "requests": [EngineRequest(**r) for r in job_raw["requests"]]})
    setting = job.combined or CombinedRule().setting()
    if job.lookup_method == "combined":
        # checked before any engine starts: vLLM loads the plugin, whose register checks it, once per process, and
        # that is at the plain engine here, before the setting is in the environment
        parse_combined(setting)
    from vllm import LLM

    def start(k: int | None, method: str = "dflash") -> tuple[Any, dict[str, Any], float]:
        """An engine of plain decoding (k None) or with the drafter (or, method "ngram", prompt lookup) proposing
        k tokens: (LLM, its kwargs, load s)."""
        kwargs = job.llm_kwargs(k, method)
        metrics = {"per_request_spec_decode_metrics": "detailed"} if k else {}
        if method == "combined":  # spec_decode.combined reads it at the engine's first drafting step
            os.environ[COMBINED_SETTING] = setting
        else:
            os.environ.pop(COMBINED_SETTING, None)
        t0 = time.perf_counter()
        llm = LLM(**kwargs, **metrics, disable_log_stats=False)
        return llm, kwargs, time.perf_counter() - t0

    def params(r: EngineRequest) -> Any:
        return vllm_sampling_params(r, list(job.stop_token_ids))

    def generate(llm: Any, requests: list[EngineRequest]) -> Generated:
        alone = len(requests) == 1  # the combined speculator's blocks by source are counted per request alone
        before = llm.collective_rpc(source_counts)[0] if alone else None
        cached = llm.collective_rpc(suffix_answers)[0] if alone else None
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                               [params(r) for r in requests], use_tqdm=False)
        got = _generated(requests, results, time.perf_counter() - t0)
        after = llm.collective_rpc(source_counts)[0] if alone else None  # None also: no combined speculator (yet)
        if after is not None:
            got.outputs[0]["sources"] = {source: {key: n - (before[source][key] if before else 0)
                                                  for key, n in count.items()} for source, count in after.items()}
        if cached is not None:  # the earlier answers its suffix tree held: only what this engine produced
            got.outputs[0]["suffix_answers_before"] = cached
        return got

    plain, kwargs, load_s = start(None)
    t0 = time.perf_counter()
    timed = None
    if job.mode == "timed":
        outputs, timed, refused = _timed(job, plain, start, generate, params, started)
    elif job.mode == "check":
        outputs, timed, refused = _check(job, plain, start, generate, params)
    else:
        outputs, refused = _continuous_batch(plain, job, params)
    wall_s = time.perf_counter() - t0
    environment = {k: os.environ.get(k, "") for k in engine_environment_keys()}
    environment["LD_PRELOAD"] = ":".join(Path(p).name for p in environment["LD_PRELOAD"].split(":") if p)
    result = {"version": vllm_version(), "llm_kwargs": kwargs, "load_s": load_s, "wall_s": wall_s,
              "outputs": outputs, "environment": environment, "timed": timed,  # file names only: reports are shared
              "refused": refused}
    tmp = workdir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, workdir / RESULT_FILE)


def _continuous_batch(llm, job: EngineJob, params: Callable[[EngineRequest], Any]
                      ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every request queued at once and decoded with continuous batching; each output is taken as it finishes
    and, with `job.stream_to`, appended to that file at least every STREAM_EVERY_S seconds (a killed run keeps
    them). Generating in chunks instead left each chunk's tail of long requests running a nearly empty batch.
    Returns the outputs and the requests the engine refused (id: `refusal`), those streamed first as
    `{"id", "refused"}` lines."""
    from tqdm import tqdm

    from vllm.sampling_params import RequestOutputKind

    requests = {r.id: r for r in job.requests}
    refused: dict[str, str] = {}
    for r in job.requests:
        try:
            p = params(r)
            p.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks: the finished output only
            llm.llm_engine.add_request(r.id, {"prompt_token_ids": r.prompt_token_ids}, p)
        except refused_errors() as err:
            refused[r.id] = refusal(err)
    if job.stream_to and refused:
        _append(job.stream_to, [{"id": rid, "refused": why} for rid, why in refused.items()])
    outputs: list[dict[str, Any]] = []
    unsaved: list[dict[str, Any]] = []
    saved_at = time.monotonic()
    with tqdm(total=len(requests) - len(refused), desc="vLLM generating", unit="request", dynamic_ncols=True,
              mininterval=5) as bar:
        while llm.llm_engine.has_unfinished_requests():
            finished = [_output(requests[r.request_id], r) for r in llm.llm_engine.step() if r.finished]
            outputs += finished
            unsaved += finished
            if finished:
                bar.update(len(finished))
            if job.stream_to and unsaved and (time.monotonic() - saved_at > STREAM_EVERY_S
                                              or not llm.llm_engine.has_unfinished_requests()):
                _append(job.stream_to, [{k: o[k] for k in ("id", "token_ids", "finish_reason", "stop_reason")}
                                        for o in unsaved])
                unsaved, saved_at = [], time.monotonic()
    order = {r.id: i for i, r in enumerate(job.requests)}
    return sorted(outputs, key=lambda o: order[o["id"]]), refused


def _append(path: str, rows: list[dict[str, Any]]) -> None:
    """`rows` appended to the JSONL file `path`, on disk when this returns."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


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


def _generated(requests: list[EngineRequest], results: list[Any], wall_s: float) -> Generated:
    """A `generate` call's `Generated`, from vLLM's results of `requests` and the stopwatch's `wall_s`."""
    stats = [res.metrics for res in results]
    timed = all(m is not None for m in stats)
    last = max(m.last_token_ts for m in stats) if timed else float("nan")
    return Generated([_output(r, res) for r, res in zip(requests, results)],
                     last - min(m.queued_ts for m in stats) if timed else float("nan"),
                     last - min(m.first_token_ts for m in stats) if timed else float("nan"), wall_s,
                     sum(res.num_cached_tokens or 0 for res in results))


def _timed(job: EngineJob, plain: Any, start, generate, params: Callable[[EngineRequest], Any], started: float
           ) -> tuple[list[dict], dict[str, Any], dict[str, str]]:
    """The eval's speedup protocol (runs in the child). Returns the plain outputs to each prompt's natural stop
    (the reference: the lossless check and each prompt's length), per speculation length K the timings, and the
    requests the plain engine or the first speculative one refuses (`_screened`: left out of every run).

    1. Plain decoding warms up (one short request), then decodes every prompt alone to its natural stop (skipped
       where every request already has its timed length and `ignore_eos`: a `lookup_job`; no outputs then).
    2. For each K of `job.speculative_tokens` in order (the first always; each next one only while the budget,
       counted from the child's start, still holds the most any K has cost so far): a speculative engine starts
       beside the plain one and warms up; every prompt is decoded `repeats` times by each side, alone, at its
       natural length with `ignore_eos` (both sides decode the same number of tokens; greedy: the same tokens),
       alternating which side goes first from prompt to prompt and from repeat to repeat (ABBA), so that a change
       of load on the machine hits both alike, each run `idle_s` after the last and after both engines' prefix caches
       are emptied (no prompt is served from an earlier request's cache); then each concurrency c: the first
       c prompts (cycled), decoded together, the same way. Every run is timed by the engine core (from the
       arrival of its first request to its last token: `core_s`; from its first token to its last: `decode_s`)
       and by a stopwatch around the call (`wall_s`). The speculative engine is shut down before the next K starts.
    3. Then vLLM's prompt lookup at K = `job.ngram_tokens`, the same way, at batch 1 and at each concurrency
       (whatever the budget: a baseline asked for is measured); its run says `"method": "ngram"` (or, with
       `job.lookup_method` "suffix", vLLM's suffix decoding: `"method": "suffix"`; "combined", the drafter with
       the combined speculator's plugin on: `"method": "combined"`, each output with its blocks by source), on
       the first `job.free_limit` prompts where it is set."""
    import gc

    todo = [("dflash", k) for k in job.speculative_tokens]
    todo += [(job.lookup_method, job.ngram_tokens)] if job.ngram_tokens else []
    opened = start(todo[0][1], todo[0][0])  # before minutes of decoding: a drafter vLLM refuses fails first
    requests, refused = _screened([plain, opened[0]], job.requests, params)
    if not requests:
        return [], {"runs": [], "skipped": [], "repeats": job.repeats, "budget_s": job.budget_s,
                    "concurrency": job.concurrency}, refused
    first = requests[0]
    warm_up = [replace(first, id="warm-up", max_tokens=min(8, first.max_tokens))]
    generate(plain, warm_up)
    if all(r.ignore_eos for r in requests):  # lengths fixed by an earlier job's reference pass (`lookup_job`)
        natural, fixed = [], requests
    else:
        natural = [generate(plain, [r]).outputs[0] for r in requests]
        fixed = [at_length(r, len(o["token_ids"])) for r, o in zip(requests, natural)]
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
        run = _timed_k(job, plain, opened, generate, warm_up,
                       fixed if method == "dflash" else fixed[:job.free_limit], method, k)
        del opened
        gc.collect()
        run["seconds"] = time.perf_counter() - t0
        most = max(most, run["seconds"])
        named = {"ngram": "prompt lookup ", "suffix": "suffix decoding ", "combined": "combined "}.get(method, "")
        print(f"timed: {named}K={k} done in {run['seconds']:.0f} s "
              f"({time.perf_counter() - started:.0f} s in all)", flush=True)
        runs.append(run)
    return natural, {"runs": runs, "skipped": skipped, "repeats": job.repeats, "budget_s": job.budget_s,
                     "concurrency": job.concurrency}, refused


def _timed_k(job: EngineJob, plain: Any, opened: tuple[Any, dict[str, Any], float], generate,
             warm_up: list[EngineRequest], fixed: list[EngineRequest], method: str, k: int) -> dict[str, Any]:
    """Step 2 (or 3) of `_timed` at one K: the speculative engine `opened` (LLM, its kwargs, load s) warms up,
    every prompt of `fixed` (at its natural length) is timed alone beside plain decoding, then each concurrency;
    the engine is shut down. Returns the K's run: its timings and its speculative outputs at batch 1."""
    spec, kwargs, load_s = opened
    generate(spec, warm_up)
    sides = {"plain": plain, "spec": spec}
    run: dict[str, Any] = {"k": k, "method": method, "llm_kwargs": kwargs, "load_s": load_s, "outputs": [],
                           "batch1": [], "concurrency": []}
    for n, batch in [(1, [r]) for r in fixed] + [
            (c, [replace(fixed[j % len(fixed)], id=f"{fixed[j % len(fixed)].id}#{j}") for j in range(c)])
            for c in job.concurrency]:
        times, outputs = _time_batch(sides, generate, n, batch, job.repeats,
                                     len(run["batch1"]) + len(run["concurrency"]), idle_s(job.device))
        if n == 1:
            run["outputs"] += outputs
        run["batch1" if n == 1 else "concurrency"].append(times)
    spec.llm_engine.engine_core.shutdown()
    return run


def _time_batch(sides: dict[str, Any], generate, n: int, batch: list[EngineRequest], repeats: int,
                parity: int, idle: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One batch of `n` requests timed `repeats` times by each side, the side that goes first alternating from
    batch to batch (`parity`: the batches timed before it) and from repeat to repeat (ABBA), each run `idle`
    seconds after the last. Returns its times and the speculative side's outputs of the first repeat."""
    times: dict[str, Any] = {"requests": n, "tokens": sum(r.max_tokens for r in batch)}
    if n == 1:
        times["id"] = batch[0].id
    outputs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for side in ("plain", "spec") if (parity + repeat) % 2 == 0 else ("spec", "plain"):
            time.sleep(idle)
            # Every timed run prefills cold: the plain engine holds the prompts of its natural pass, the
            # speculative one has not seen them, and with room for several sequences (--concurrency) plain's
            # prefill would be a cache hit (BENCHMARKS "A prompt cached on one side only").
            sides[side].reset_prefix_cache()
            got = generate(sides[side], batch)
            for clock in ("core_s", "decode_s", "wall_s", "cached_tokens"):
                times.setdefault(f"{side}_{clock}", []).append(getattr(got, clock))
            if side == "spec" and repeat == 0:
                outputs = got.outputs
    return times, outputs


def _check(job: EngineJob, plain: Any, start, generate, params: Callable[[EngineRequest], Any]
           ) -> tuple[list[dict], dict[str, Any], dict[str, str]]:
    """The lossless check alone (the eval's fp32 rerun of the prompts whose speculative output differed): every
    prompt decoded alone to its natural stop, by plain decoding and then with the drafter at K =
    `speculative_tokens[0]`, once each. Returns the plain outputs and the speculative ones as `_timed` does, without
    its timed runs (two decodes per prompt instead of three, no idle gaps), and the requests either engine refuses
    (`_screened`: left out of both)."""
    k = job.speculative_tokens[0]
    spec, kwargs, load_s = start(k, "combined" if job.lookup_method == "combined" else "dflash")
    requests, refused = _screened([plain, spec], job.requests, params)
    natural = [generate(plain, [r]).outputs[0] for r in requests]
    outputs = [generate(spec, [r]).outputs[0] for r in requests]
    spec.llm_engine.engine_core.shutdown()
    return natural, {"runs": [{"k": k, "llm_kwargs": kwargs, "load_s": load_s, "outputs": outputs}]}, refused


def _output(request: EngineRequest, result: Any) -> dict[str, Any]:
    out = result.outputs[0]
    spec, stats = out.spec_decode_metrics, result.metrics
    decode_s = (stats.last_token_ts - stats.first_token_ts) if stats is not None else float("nan")
    return asdict(EngineOutput(id=request.id, token_ids=list(out.token_ids), finish_reason=out.finish_reason,
                               decode_s=decode_s, accepted=list(spec.per_step_accepted) if spec is not None else [],
                               drafted=list(spec.per_step_drafted) if spec is not None else [],
                               stop_reason=out.stop_reason))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
