"""What runs inside the engine's child process (`python -m dflash_train.engine.child JOB_DIR`, started by
`runner.run_engine`): read the job, decode it in vLLM, write result.json atomically.

Three modes. `batch` (capture): every request at once, continuous batching. `timed` (eval): the speedup protocol,
after the job's capture sample (the demo's probe: capture's batch, then the timed runs, in one engine start),
`_timed` below: plain decoding and the speculative engines (the drafter at its first K, and every free speculator and
the baseline drafter asked for) alive side by side in the child, each warmed up; prompt by prompt, plain decoding
decodes it to its natural stop (the reference output and length, and plain decoding's timed run), then each speculator
at that fixed length (`ignore_eos`: every side decodes the same number of tokens), in rotated order, at batch 1 and at
the requested concurrencies; each run timed twice, by the engine core's timestamps (request arrival, first and last
token) and by a stopwatch around the call. `check` (the eval's fp32 rerun of its mismatches): each prompt alone, plain
and speculative at one K (the drafter, or the combined speculator where the job names its `combined` setting), once each
to its natural stop, untimed.
Acceptance comes from vLLM's per-request speculative-decoding metrics (the accepted drafts of every verification step).
The prompts are token ids rendered by the project (`target.render`), so the engine and the project's loop decode the
very same prompts. A request the engine refuses when it is added (vLLM validates its sampling parameters and compiles
its grammar there) is left out in every mode, the others decoded: result.json's `refused` names each with its reason
(`refusal`); timed and check first screen every request on each engine they open at the start (`_screened`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from dflash_train.engine.install import engine_environment_keys, vllm_version
from dflash_train.engine.jobs import (DRAFTERS, FREE_NAMES, EngineJob, EngineOutput, EngineRequest, at_length,
                                      sampling_params)
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


@contextlib.contextmanager
def _kernel_scan_safe() -> Iterator[None]:
    """An engine's start with llvmlite's modules out of `sys.modules`. vLLM 0.32's CPU backend rebinds its kernel
    overrides at every engine's start by scanning each module's attributes, and trips over llvmlite's function
    wrappers (`AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`), which prompt lookup's proposer
    imports: without this no engine starts in a process after a prompt-lookup one. No llvmlite module holds a
    vLLM kernel, and they are back as they were when the start returns."""
    hidden = {name: mod for name, mod in sys.modules.items() if name.partition(".")[0] == "llvmlite"}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


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
    job = EngineJob(**{**job_raw, "requests": [EngineRequest(**r) for r in job_raw["requests"]],
                       "capture_sample": [EngineRequest(**r) for r in job_raw.get("capture_sample") or []]})
    setting = job.combined or CombinedRule().setting()
    if job.combined:
        # checked before any engine starts: vLLM loads the plugin, whose register checks it, once per process, and
        # that is at the plain engine here, before the setting is in the environment
        parse_combined(setting)
    from vllm import LLM

    def start(k: int | None, method: str = "dflash") -> tuple[Any, dict[str, Any], float]:
        """An engine of plain decoding (k None) or with the drafter (or another speculator of EngineJob.free's
        methods: llm_kwargs) proposing k tokens: (LLM, its kwargs, load s)."""
        kwargs = job.llm_kwargs(k, method)
        metrics = {"per_request_spec_decode_metrics": "detailed"} if k else {}
        if method == "combined":  # spec_decode.combined reads it at the engine's first drafting step
            os.environ[COMBINED_SETTING] = setting
        else:
            os.environ.pop(COMBINED_SETTING, None)
        t0 = time.perf_counter()
        with _kernel_scan_safe():
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
    timed, sample, sample_s = None, [], 0.0
    if job.capture_sample:  # as capture decodes them, before the timed runs
        sample, _ = _continuous_batch(plain, replace(job, requests=job.capture_sample, stream_to=None), params)
        sample_s = time.perf_counter() - t0
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
              "refused": refused, "capture_sample": sample, "capture_sample_s": sample_s}
    tmp = workdir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, workdir / RESULT_FILE)


def _continuous_batch(llm, job: EngineJob, params: Callable[[EngineRequest], Any]
                      ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every request queued at once and decoded with continuous batching; each output is taken as it finishes
    and, with `job.stream_to`, appended to that file at least every STREAM_EVERY_S seconds (a killed run keeps
    them). Generating in chunks instead left each chunk's tail of long requests running a nearly empty batch.
    With `job.states_to` the tapped states are recorded in the same forwards (`taps.Recorder`): a finished request
    is sent again whole as a one-token request (`taps.tail_id`, its final token's states), and its output is taken
    when that one is done and its states file written. Returns the outputs and the requests the engine refused (id:
    `refusal`), those streamed first as `{"id", "refused"}` lines."""
    from tqdm import tqdm

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from dflash_train.engine.taps import TAIL, Recorder, tail_id

    recorder = None
    if job.states_to:
        recorder = Recorder(job.states_to, job.state_layers, job.state_topk,
                            llm.llm_engine.vllm_config.cache_config.block_size)
        llm.collective_rpc(recorder.install)
    requests = {r.id: r for r in job.requests}
    refused: dict[str, str] = {}
    for r in job.requests:
        try:
            p = params(r)
            p.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks: the finished output only
            if recorder:
                recorder.add(r.id, r.prompt_token_ids)
            llm.llm_engine.add_request(r.id, {"prompt_token_ids": r.prompt_token_ids}, p)
        except refused_errors() as err:
            refused[r.id] = refusal(err)
    if job.stream_to and refused:
        _append(job.stream_to, [{"id": rid, "refused": why} for rid, why in refused.items()])
    tail = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    outputs: list[dict[str, Any]] = []
    unsaved: list[dict[str, Any]] = []
    waiting: dict[str, dict[str, Any]] = {}  # finished, their tail re-run not yet
    saved_at = time.monotonic()
    with tqdm(total=len(requests) - len(refused), desc="vLLM generating", unit="request", dynamic_ncols=True,
              mininterval=5) as bar:
        while llm.llm_engine.has_unfinished_requests():
            finished = []
            for r in llm.llm_engine.step():
                if not r.finished:
                    continue
                if recorder is None:
                    finished.append(_output(requests[r.request_id], r))
                elif r.request_id.endswith(TAIL):
                    rid = r.request_id.removesuffix(TAIL)
                    recorder.finish(rid)
                    finished.append(waiting.pop(rid))
                else:
                    out = waiting[r.request_id] = _output(requests[r.request_id], r)
                    sequence = requests[r.request_id].prompt_token_ids + out["token_ids"]
                    recorder.extend(r.request_id, sequence)
                    llm.llm_engine.add_request(tail_id(r.request_id), {"prompt_token_ids": sequence}, tail)
            outputs += finished
            unsaved += finished
            if finished:
                bar.update(len(finished))
            if job.stream_to and unsaved and (time.monotonic() - saved_at > STREAM_EVERY_S
                                              or not llm.llm_engine.has_unfinished_requests()):
                _append(job.stream_to, [{k: o[k] for k in ("id", "token_ids", "finish_reason", "stop_reason")}
                                        for o in unsaved])
                unsaved, saved_at = [], time.monotonic()
    if recorder:
        llm.collective_rpc(recorder.remove)
        print(f"states: {len(outputs)} requests recorded, {recorder.from_cache} positions taken from the request "
              f"that computed them (prefix cache), {recorder.tail_rows} computed again by the tail re-runs (blocks of "
              f"{recorder.block})", flush=True)
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
    (the reference: the lossless check and each prompt's length), per speculator and K the timings, and the
    requests the plain engine or one of the group's refuses (`_screened`: left out of every run).

    1. The group: the drafter at the first K of `job.speculative_tokens` and each free speculator of `job.free`
       (vLLM's prompt lookup "ngram", suffix decoding "suffix", "combined": the drafter with the combined
       speculator's plugin on, each output with its blocks by source, or "baseline": the baseline drafter), their
       engines started beside the plain one and warmed up, as plain decoding is (one short request).
    2. Prompt by prompt, plain decoding decodes it alone to its natural stop (the reference; its first timed run), then
       each speculator at that length with `ignore_eos` (every side decodes the same number of tokens; greedy: the same
       tokens), the order of the speculators rotated from prompt to prompt; each further repeat of `repeats` times every
       side, plain decoding too, the order rotated from repeat to repeat (with one speculator: ABBA), so that a change
       of load on the machine hits every side alike. Plain decoding's run is shared by every speculator, and a free
       speculator (not one of the DRAFTERS) times only the first `job.free_limit` prompts where it is set. (Where every
       request already has its timed length and `ignore_eos`, a `free_job`, there is no reference: plain decoding's
       first run is rotated with the others, and no outputs are returned.) Each run comes `idle_s` after the last, after
       its engine's prefix cache is emptied (no prompt is served from an earlier request's cache); then each concurrency
       c: the first c prompts (cycled), decoded together, the same way. Every run is timed by the engine core (from the
       arrival of its first request to its last token: `core_s`; from its first token to its last: `decode_s`) and by a
       stopwatch around the call (`wall_s`). The group's engines are shut down after it.
    3. Each further K of `job.speculative_tokens` in order, while the budget, counted from the child's start,
       still holds the most a drafter K has cost so far (its engine's start, its runs and plain decoding's beside
       them): its engine alone beside the plain one, the same way. The free speculators' seconds are not counted
       against the budget, the DRAFTERS' are (the baseline drafter's too: a drafter's timed runs)."""
    import gc

    group = [("dflash", k) for k in job.speculative_tokens[:1]] + [(method, k) for method, k in job.free]
    # before minutes of decoding: a drafter vLLM refuses fails first, and a request one of them refuses is left out
    opened = [start(k, method) for method, k in group]
    requests, refused = _screened([plain, *(llm for llm, _, _ in opened)], job.requests, params)
    if not requests:
        return [], {"runs": [], "skipped": [], "repeats": job.repeats, "budget_s": job.budget_s,
                    "concurrency": job.concurrency}, refused
    first = requests[0]
    warm_up = [replace(first, id="warm-up", max_tokens=min(8, first.max_tokens))]
    generate(plain, warm_up)
    # lengths fixed by an earlier job's reference pass (`free_job`), else found by this one's
    natural: list[dict[str, Any]] | None = None if all(r.ignore_eos for r in requests) else []
    runs, fixed = _timed_group(job, plain, group, opened, generate, warm_up, requests, natural)
    del opened
    gc.collect()
    _said(runs, started)
    skipped: list[int] = []
    most = max((r["seconds"] + r["plain_shared_s"] for r in runs if r["method"] == "dflash"), default=0.0)
    free_s = sum(r["seconds"] for r in runs if r["method"] not in DRAFTERS)  # not the K sweep's budget
    for k in job.speculative_tokens[1:]:
        if job.budget_s is not None and time.perf_counter() - started - free_s + most > job.budget_s:
            skipped.append(k)
            continue
        more, _ = _timed_group(job, plain, [("dflash", k)], [start(k)], generate, warm_up, fixed)
        gc.collect()
        _said(more, started)
        most = max(most, more[0]["seconds"])
        runs += more
    return natural or [], {"runs": runs, "skipped": skipped, "repeats": job.repeats, "budget_s": job.budget_s,
                           "concurrency": job.concurrency}, refused


def _said(runs: list[dict[str, Any]], started: float) -> None:
    """One line per timed run: what it timed and its seconds, and the child's so far."""
    for run in runs:
        named = f"{FREE_NAMES[run['method']]} " if run["method"] in FREE_NAMES else ""
        print(f"timed: {named}K={run['k']} done in {run['seconds']:.0f} s ({time.perf_counter() - started:.0f} s in "
              f"all)", flush=True)


def _timed_group(job: EngineJob, plain: Any, group: list[tuple[str, int]], opened: list[tuple[Any, dict, float]],
                 generate, warm_up: list[EngineRequest], requests: list[EngineRequest],
                 natural: list[dict[str, Any]] | None = None
                 ) -> tuple[list[dict[str, Any]], list[EngineRequest]]:
    """Steps 1 to 3 of `_timed`: the speculative engines `opened` (LLM, its kwargs, load s), one per (method, K) of
    `group`, warm up; every prompt of `requests` is timed alone by plain decoding and by each of them (a free
    speculator, not one of the DRAFTERS: the first `job.free_limit`), then each concurrency; the engines are shut down.
    With `natural` (a list) plain decoding's first run of each prompt is its reference, to its natural stop, appended
    there, and the others decode at its length; without, `requests` are at their lengths already. Returns each one's run
    (its timings, each beside plain decoding's of the same request, its speculative outputs at batch 1, and its seconds:
    its engine's start, its runs and its share of plain decoding's beside them), and the requests at their lengths."""
    runs = [{"k": k, "method": method, "llm_kwargs": kwargs, "load_s": load_s, "outputs": [], "batch1": [],
             "concurrency": [], "seconds": load_s, "plain_shared_s": 0.0}
            for (method, k), (_, kwargs, load_s) in zip(group, opened)]
    for (spec, _, _), run in zip(opened, runs):
        t0 = time.perf_counter()
        generate(spec, warm_up)
        run["seconds"] += time.perf_counter() - t0
    limit = len(requests) if job.free_limit is None else job.free_limit
    idle, fixed = idle_s(job.device), []
    every = range(len(runs))
    batches = [(1, r, [i for i in every if runs[i]["method"] in DRAFTERS or at < limit])
               for at, r in enumerate(requests)]
    batches += [(c, None, list(every)) for c in job.concurrency]
    for parity, (n, request, timing) in enumerate(batches):
        reference = None
        if request is not None and natural is not None:  # plain decoding's first run: the reference
            reference = _run(plain, generate, [request], idle)
            natural.append(reference[0].outputs[0])
            request = at_length(request, len(natural[-1]["token_ids"]))
        if request is not None:
            fixed.append(request)
        batch = [request] if request is not None else [
            replace(fixed[j % len(fixed)], id=f"{fixed[j % len(fixed)].id}#{j}") for j in range(n)]
        times, outputs, seconds = _time_batch([plain, *(opened[i][0] for i in timing)], generate, n, batch,
                                              job.repeats, parity, idle, reference)
        for run, side_times, side_outputs, side_s in zip((runs[i] for i in timing), times, outputs, seconds[1:]):
            # plain decoding's runs shared out among the speculators it ran beside; the rest of them, which the
            # others paid, in plain_shared_s (alone, a K would cost both)
            run["seconds"] += side_s + seconds[0] / len(timing)
            run["plain_shared_s"] += seconds[0] * (1 - 1 / len(timing))
            if n == 1:
                run["outputs"] += side_outputs
            run["batch1" if n == 1 else "concurrency"].append(side_times)
    for spec, _, _ in opened:
        spec.llm_engine.engine_core.shutdown()
    return runs, fixed


def _run(llm: Any, generate, batch: list[EngineRequest], idle: float) -> tuple[Generated, float]:
    """One timed run: `idle` seconds after the last, its engine's prefix cache emptied, then `batch` decoded; what it
    generated and the seconds it took. Every timed run prefills cold: the plain engine holds the prompts it decoded
    before, a speculative one has not seen them, and with room for several sequences (--concurrency) plain's prefill
    would be a cache hit (BENCHMARKS "A prompt cached on one side only")."""
    time.sleep(idle)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    got = generate(llm, batch)
    return got, time.perf_counter() - t0


def _time_batch(sides: list[Any], generate, n: int, batch: list[EngineRequest], repeats: int,
                parity: int, idle: float, reference: tuple[Generated, float] | None = None
                ) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]], list[float]]:
    """One batch of `n` requests timed `repeats` times by each engine of `sides` (plain decoding first in the list,
    then each speculator), the order rotated from batch to batch (`parity`: the batches timed before it) and from
    repeat to repeat (two sides: ABBA), each run `idle` seconds after the last; with `reference` (plain decoding's
    run of the batch just before, and its seconds) that is plain decoding's first repeat, and the speculators'
    first runs follow it, rotated among themselves. Returns per speculator its times beside plain decoding's, its
    outputs of the first repeat, and each side's seconds (plain decoding's first)."""
    common: dict[str, Any] = {"requests": n, "tokens": sum(r.max_tokens for r in batch)}
    if n == 1:
        common["id"] = batch[0].id
    clocks: list[dict[str, list]] = [{} for _ in sides]
    outputs: list[list[dict[str, Any]]] = [[] for _ in sides]
    seconds = [0.0 for _ in sides]

    def record(i: int, got: Generated, took: float) -> None:
        seconds[i] += took
        for clock in ("core_s", "decode_s", "wall_s", "cached_tokens"):
            clocks[i].setdefault(clock, []).append(getattr(got, clock))

    if reference is not None:
        record(0, *reference)
    for repeat in range(repeats):
        order = list(range(1 if reference is not None and repeat == 0 else 0, len(sides)))
        shift = (parity + repeat) % len(order) if order else 0  # none: a prompt past free_limit, no drafter K
        for i in order[shift:] + order[:shift]:
            got, took = _run(sides[i], generate, batch, idle)
            record(i, got, took)
            if repeat == 0:
                outputs[i] = got.outputs
    times = [{**common, **{f"plain_{clock}": v for clock, v in clocks[0].items()},
              **{f"spec_{clock}": v for clock, v in own.items()}} for own in clocks[1:]]
    return times, outputs[1:], seconds


def _check(job: EngineJob, plain: Any, start, generate, params: Callable[[EngineRequest], Any]
           ) -> tuple[list[dict], dict[str, Any], dict[str, str]]:
    """The lossless check alone (the eval's fp32 rerun of the prompts whose speculative output differed): every
    prompt decoded alone to its natural stop, by plain decoding and then with the drafter at K =
    `speculative_tokens[0]`, once each. Returns the plain outputs and the speculative ones as `_timed` does, without
    its timed runs (two decodes per prompt instead of three, no idle gaps), and the requests either engine refuses
    (`_screened`: left out of both)."""
    k = job.speculative_tokens[0]
    spec, kwargs, load_s = start(k, "combined" if job.combined else "dflash")
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
