"""Stored states or online training: what each costs on this machine, measured side by side in one run.

    python benchmarks/bench_online.py [--prompts DIR] [--num-prompts 40] [--max-prompt-tokens 384]
                                      [--max-new-tokens 128] [--batch-size 16] [--steps 20] [--repeats 2]
                                      [--recipe recipes/smollm2-135m-demo.yaml] [--threads N] [--work DIR]
                                      [--no-engine]

Every measurement goes through the stages themselves, on the same prompts (the first --num-prompts training prompts
of at most --max-prompt-tokens tokens):
  (a) disk per token of the captured stores: token-only (`capture --storage none`), bf16 states, fp8 states (the same
      states rewritten by the store writer), each checked by `verify`;
  (b) capture throughput, stored tokens/s: token-only and with bf16 states, through vLLM (`--engine vllm`: with states
      it adds the transformers prefill that records them; vLLM's start-up is reported apart) and through the one-pass
      loop; kinds alternate in order across --repeats (A B C D, then D C B A), the fastest run of each counts;
  (c) training: the trainer itself (`train.py`, one process, the recipe's shape, no context warm-up) on the same store,
      stored states against online (`data.hidden_states: online`), alternating, --steps steps each; the trainer's own
      per-step time (tokens / tokens_per_s of metrics.jsonl) after the first two steps;
  (d) the break-even number of epochs: from there on, capturing the states once costs less time than computing them
      in every epoch (`break_even_epochs`).

`probe_rates` (a short measurement of the same rates with the one-pass loop: one capture batch each way and a few
training steps each way) feeds `choose_hidden_states` (dflash_train.support.measure: a pure decision from those
rates, the epochs and the disk, which the demo's plan takes too); the tests cover both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash_train.support.measure import break_even_epochs, choose_hidden_states

REPO = Path(__file__).resolve().parent.parent


# --- the probe ------------------------------------------------------------------------------------------------------


def probe_rates(target, prompts: list[list[int]], recipe, max_new_tokens: int, batch_size: int = 8,
                steps: int = 3, layer_ids: list[int] | None = None) -> dict[str, float]:
    """The rates `choose_hidden_states` needs, measured quickly with the one-pass capture (the demo's): one batch of
    `prompts` captured with bf16 states and once token-only (each written to a store), then `steps` training steps of
    the recipe's shape (measure.step_fn: drafter forward, loss, backward, AdamW) on those sequences with the stored
    states and with the states computed online (stages.train.data.OnlineStates, the trainer's), alternating; medians
    after the first of each. `target` is a loaded target.Target in the compute dtype."""
    import torch

    from dflash_train.states import generate_and_capture
    from dflash_train.stages.capture.command import resolve_layer_ids
    from dflash_train.stages.train.data import OnlineStates, collate
    from dflash_train.store.writer import StoreWriter
    from dflash_train.store.format import floor_bytes_per_token
    from dflash_train.support import measure

    layers = layer_ids or resolve_layer_ids(target.num_layers, None, 5)
    stop, pad = target.stop_token_ids(), target.tokenizer.pad_token_id
    batch = sorted(prompts, key=len)[:batch_size]
    device = next(target.model.parameters()).device
    dtype = next(target.model.parameters()).dtype
    H = target.config.hidden_size
    generate_and_capture(target.model, batch[:2], layers, 2, stop, pad)  # warm-up
    work = Path(tempfile.mkdtemp(prefix="probe_online_"))
    seconds, samples = {}, []
    try:
        for storage in ("bf16", "none"):
            t0 = time.perf_counter()
            got = generate_and_capture(target.model, batch, layers if storage != "none" else [], max_new_tokens,
                                       stop, pad)
            with StoreWriter(work / storage, target={"name": target.name}, target_layer_ids=layers, hidden_size=H,
                             storage_dtype=storage) as writer:
                for k, c in enumerate(got):
                    mask = torch.zeros(len(c.input_ids), dtype=torch.bool)
                    mask[c.num_prompt_tokens:] = True
                    writer.add(torch.tensor(c.input_ids), mask, c.hidden_states, id=str(k))
                    if storage == "bf16":
                        samples.append({"input_ids": torch.tensor(c.input_ids), "loss_mask": mask,
                                        "hidden_states": c.hidden_states.to(torch.bfloat16)})
            seconds[storage] = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stored_tokens = sum(len(s["input_ids"]) for s in samples)

    mb, length = recipe.train.micro_batch_size, recipe.data.max_length
    shape = argparse.Namespace(hidden=H, layers=recipe.drafter.num_layers, target_layers=len(layers),
                               vocab=target.config.vocab_size, seq=length, anchors=recipe.objective.num_anchors,
                               block=recipe.drafter.block_size, batch=mb, head="fused",
                               head_chunk=recipe.objective.head_chunk_tokens,
                               attention="flex" if device.type == "cuda" else "blockwise")
    drafter = measure.make_drafter(shape, device, dtype)
    embed = target.model.get_input_embeddings().weight.detach()
    head = target.model.get_output_embeddings().weight.detach()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    online = OnlineStates(target, layers, length)
    rows = [[samples[i % len(samples)]] for i in range(mb)]
    step_s: dict[str, list[float]] = {"stored": [], "online": []}
    step_tokens = sum(min(len(row[0]["input_ids"]), length) for row in rows)
    for step in range(2 * steps):
        source = ("stored", "online")[step % 2]
        t0 = time.perf_counter()
        data = collate(online.add(rows) if source == "online" else rows, length)
        data = {k: v.to(device) for k, v in data.items()}
        measure.step_fn(shape, drafter, embed, head, data, optimizer, step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s[source].append(time.perf_counter() - t0)
    stored_s, online_s = (statistics.median(step_s[k][1:] or step_s[k]) for k in ("stored", "online"))
    return {"capture_states_tok_s": stored_tokens / seconds["bf16"],
            "capture_tokens_tok_s": stored_tokens / seconds["none"],
            "train_stored_tok_s": step_tokens / stored_s, "train_online_tok_s": step_tokens / online_s,
            "train_stored_step_s": stored_s, "train_online_step_s": online_s,
            "state_bytes_per_token": float(floor_bytes_per_token(
                {"num_tapped": len(layers), "hidden_size": H, "storage_dtype": "bf16", "topk": 0})),
            "token_bytes_per_token": float(floor_bytes_per_token(
                {"num_tapped": len(layers), "hidden_size": H, "storage_dtype": "none", "topk": 0}))}


# --- the benchmark ------------------------------------------------------------------------------------------------


CAPTURES = {  # label -> capture options
    "token-only, vLLM": {"engine": "vllm", "storage": "none"},
    "bf16 states, vLLM": {"engine": "vllm", "storage": "bf16"},
    "bf16 states, one-pass": {"engine": "own", "storage": "bf16"},
    "token-only, one-pass": {"engine": "own", "storage": "none"},
}


def kept_limit(prompts: str, target: str, wanted: int, max_prompt_tokens: int) -> tuple[int, int]:
    """(--limit to read, prompts kept): how many training prompts to read so that `wanted` of them are kept."""
    from dflash_train.prompts import load_prompt_records
    from dflash_train.target import load_tokenizer, render_prompt

    tokenizer = load_tokenizer(target)
    records, _ = load_prompt_records(prompts, "train")
    kept = 0
    for i, record in enumerate(records):
        kept += len(render_prompt(tokenizer, record.messages, record.tools)) <= max_prompt_tokens
        if kept == wanted:
            return i + 1, kept
    return len(records), kept


def run_capture(args, label: str, out: Path, limit: int) -> dict[str, Any]:
    from dflash_train.stages.capture.config import CaptureConfig
    from dflash_train.stages.capture.command import capture

    cfg = CaptureConfig(prompts=args.prompts, out=str(out), target=args.target, limit=limit,
                        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, threads=args.threads, **CAPTURES[label])
    t0 = time.perf_counter()
    manifest = capture(cfg)
    seconds = time.perf_counter() - t0
    engine = out / "engine" / "result.json"
    start = json.loads(engine.read_text())["load_s"] if engine.exists() else 0.0
    return {"seconds": seconds, "engine_start_s": start, "tokens": manifest["num_tokens"],
            "tok_s": manifest["num_tokens"] / (seconds - start)}


def run_training(args, store: Path, source: str, out: Path) -> dict[str, Any]:
    command = [sys.executable, str(REPO / "train.py"), args.recipe, f"data.stores=[{store}]",
               f"data.hidden_states={source}", f"output_dir={out}", f"train.max_steps={args.steps}",
               "train.time_budget_s=null", "eval.every=0", "eval.at_end=false", "checkpoint.every=1000000",
               "checkpoint.resume=never", "objective.context_warmup_ratio=0.0", "logging.progress_bar=false",
               f"train.cpu_threads={args.threads or 'null'}"]
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_online: training ({source}) failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["kind"] == "train"][2:]  # the first steps pay the allocator's growth
    times = [float(r["train_time"]) for r in rows]  # the training clock: evals and checkpoints excluded
    return {"step_s": statistics.median(b - a for a, b in zip(times, times[1:])),
            "tok_s": statistics.median(r["tokens_per_s"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    from dflash_train.store.reader import open_store
    from dflash_train.store.verify import verify_store

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="data/prompts/sharegpt", help="an ingest output folder (its train split)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=40, help="prompts kept (of at most --max-prompt-tokens)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="capture batch size")
    p.add_argument("--recipe", default="recipes/smollm2-135m-demo.yaml", help="the training runs' recipe")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each capture kind and training mode")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of the captures and trainings (on a shared, loaded box 1 beats 2)")
    p.add_argument("--work", default=None, help="folder for the stores and runs (default: a temporary one, removed)")
    p.add_argument("--no-engine", dest="engine", action="store_false", help="skip the vLLM captures")
    args = p.parse_args(argv)
    args.prompts = str(Path(args.prompts).resolve())
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_online_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    limit, kept = kept_limit(args.prompts, args.target, args.num_prompts, args.max_prompt_tokens)
    labels = [label for label in CAPTURES if args.engine or CAPTURES[label]["engine"] != "vllm"]
    captures: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    stores: dict[str, Path] = {}
    for r in range(args.repeats):
        for label in labels if r % 2 == 0 else labels[::-1]:
            out = work / f"capture-{label.replace(', ', '-').replace(' ', '-')}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            captures[label].append(run_capture(args, label, out, limit))
            stores.setdefault(label, out)
            print(f"bench_online: capture {label} (run {r + 1}): {captures[label][-1]}", flush=True)
    best = {label: max(runs, key=lambda x: x["tok_s"]) for label, runs in captures.items()}

    states_label = "bf16 states, vLLM" if args.engine else "bf16 states, one-pass"
    tokens_label = "token-only, vLLM" if args.engine else "token-only, one-pass"
    fp8 = rewrite_fp8(stores[states_label], work / "fp8")
    disk = {}
    for name, path in (("token-only", stores[tokens_label]), ("bf16 states", stores[states_label]),
                       ("fp8 states", fp8)):
        problems = verify_store(path)
        m = open_store(path).manifest
        disk[name] = {"bytes": m["bytes"], "tokens": m["num_tokens"], "per_token": m["bytes"] / m["num_tokens"],
                      "verified": not problems}

    training: dict[str, list[dict[str, Any]]] = {"stored": [], "online": []}
    for r in range(args.repeats):
        for source in ("stored", "online") if r % 2 == 0 else ("online", "stored"):
            training[source].append(run_training(args, stores[states_label], source, work / f"train-{source}-{r}"))
            print(f"bench_online: training {source} (run {r + 1}): {training[source][-1]}", flush=True)
    fastest = {source: min(runs, key=lambda x: x["step_s"]) for source, runs in training.items()}
    load_after = os.getloadavg()

    rows = []
    for name, d in disk.items():
        rows.append((f"(a) disk per token, {name} (`verify`: {'OK' if d['verified'] else 'FAILED'})",
                     f"{d['per_token']:,.1f} bytes ({d['bytes'] / 2**20:,.2f} MiB for {d['tokens']:,} tokens)"))
    rows.append(("(a) bf16 states / token-only, bytes",
                 f"{disk['bf16 states']['bytes'] / disk['token-only']['bytes']:,.0f}x"))
    for label in labels:
        b = best[label]
        start = f"; vLLM start-up {b['engine_start_s']:.1f} s apart" if b["engine_start_s"] else ""
        rows.append((f"(b) capture {label}: stored tokens/s", f"{b['tok_s']:,.1f} ({b['tokens']:,} tokens in "
                     f"{b['seconds']:.1f} s{start})"))
    for source in ("stored", "online"):
        f = fastest[source]
        rows.append((f"(c) training step, {source} states: median s (trained tokens/s)",
                     f"{f['step_s']:.3f} ({f['tok_s']:,.0f})"))
    rows.append(("(c) online / stored step time", f"{fastest['online']['step_s'] / fastest['stored']['step_s']:.2f}x"))
    for pair in (("vLLM", "token-only, vLLM", "bf16 states, vLLM"),
                 ("one-pass", "token-only, one-pass", "bf16 states, one-pass")):
        if pair[1] not in best:
            continue
        rates = {"capture_states_tok_s": best[pair[2]]["tok_s"], "capture_tokens_tok_s": best[pair[1]]["tok_s"],
                 "train_stored_tok_s": fastest["stored"]["tok_s"], "train_online_tok_s": fastest["online"]["tok_s"],
                 "state_bytes_per_token": disk["bf16 states"]["per_token"]}
        choice = {e: choose_hidden_states(rates, e)[0] for e in (1, 6)}
        rows.append((f"(d) break-even epochs, {pair[0]} capture (choice at 1 / 6 epochs)",
                     f"{break_even_epochs(rates):.2f} ({choice[1]} / {choice[6]})"))
    print()
    print(f"{args.target}, {kept} ShareGPT train prompts of at most {args.max_prompt_tokens} tokens (read {limit}), "
          f"greedy, {args.max_new_tokens} new tokens, capture batch {args.batch_size}; training: {args.recipe} "
          f"(no context warm-up), {args.steps} steps per run, one process; {args.threads or 'all'} thread(s); "
          f"{args.repeats} runs of each, alternating, "
          f"the fastest counts; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after.")
    print()
    print("| measure | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    (work / "bench_online.json").write_text(json.dumps(
        {"captures": captures, "disk": disk, "training": training, "rows": rows}, indent=2))
    if not args.work:
        shutil.rmtree(work)
    return 0


def rewrite_fp8(src: Path, out: Path) -> Path:
    """The same samples and states as `src`, written by the store writer in fp8 (one scale per token)."""
    from dflash_train.store.writer import StoreWriter
    from dflash_train.store.reader import open_store

    store = open_store(src)
    m = store.manifest
    shutil.rmtree(out, ignore_errors=True)
    with StoreWriter(out, target=m["target"], target_layer_ids=m["target_layer_ids"], hidden_size=m["hidden_size"],
                     storage_dtype="fp8", generation=m["generation"], topk=m.get("topk", 0)) as writer:
        for item in store:
            writer.add(item["input_ids"], item["loss_mask"], item["hidden_states"], id=item["id"],
                       weight=item["weight"], topk_ids=item.get("topk_ids"), topk_logprobs=item.get("topk_logprobs"))
    return out


if __name__ == "__main__":
    sys.exit(main())
