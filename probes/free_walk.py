"""Does the walk of the free speculators (dflash_train/spec_decode/walk.py) give vLLM's tau? Prompt lookup and the
suffix tree walked over a held-out store's answers, beside what the eval measured in vLLM on the same requests.

    python probes/free_walk.py --eval-store data/store/NAME-eval --report eval/NAME [--train-store data/store/NAME
        --train-samples 24]

The eval decodes its held-out prompts in the store's order, each to the length of plain decoding's answer under the
eval's cap, and the suffix decoding engine's tree holds the answers it produced before each; the walk replays the
store's answers (the same requests, captured under the same cap) in that order, each at the K the eval timed. With
--train-store, also the first --train-samples training answers cut at the eval's cap: what the demo's probe walks
(its capture sample is spread over the training prompts' lengths instead).
"""

from __future__ import annotations

import argparse

from dflash_train import eval_report
from dflash_train.spec_decode.walk import free_walk
from dflash_train.store.reader import open_store


def requests(store: str, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of a store's first `limit` samples, the answer being its loss-masked tail."""
    samples = open_store(store)
    out = []
    for i in range(len(samples) if limit is None else min(limit, len(samples))):
        ids, mask = samples[i]["input_ids"].tolist(), samples[i]["loss_mask"].tolist()
        first = mask.index(1) if 1 in mask else len(ids)
        out.append((ids[:first], ids[first:]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval-store", required=True)
    p.add_argument("--report", required=True, help="the eval's output folder (its report.json)")
    p.add_argument("--train-store", default=None)
    p.add_argument("--train-samples", type=int, default=24)
    args = p.parse_args(argv)
    report = eval_report.load(args.report)
    cap = report.settings.options.get("max_new_tokens")
    held_out = requests(args.eval_store)
    train = requests(args.train_store, args.train_samples) if args.train_store else None
    print("| speculator | K | vLLM τ (its steps, tokens) | walked τ, held-out (steps, tokens) |"
          + (f" walked τ, first {len(train)} training answers |" if train else ""))
    print("|---|---|---|---|" + ("---|" if train else ""))
    for method in ("ngram", "suffix"):
        row = getattr(report.vllm, method, None)
        if row is None:
            continue
        walked = free_walk(method, held_out, row.k, cap)
        tokens = round(row.tau_steps * row.num_steps)
        line = (f"| {method} | {row.k} | {row.tau_steps:.3f} ({row.num_steps}, {tokens}) | "
                f"{walked.tau:.3f} ({walked.steps}, {walked.tokens}) |")
        if train:
            line += f" {free_walk(method, train, row.k, cap).tau:.3f} |"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
