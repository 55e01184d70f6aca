"""How far is a drafter from a lookup table? Slot-1 accuracy of n-gram tables built from a training store.

    python scripts/ngram_baseline.py data/store/smollm2-demo [--eval-store data/store/smollm2-demo-eval]

Builds a bigram table (anchor -> next token) and a trigram table (previous token, anchor -> next token, backing off
to the bigram) from the response tokens of the store's training split, then reports how often the table's most
frequent entry is the target's token at anchor + 1, over every held-out response anchor: on the store's own held-out
split (its first --eval-samples samples, the ones the trainer's simulated-tau eval reads), on the training split
itself (what memorising the data gives), and on every sample of --eval-store. Compare with a drafter's slot-1
accuracy (metrics.jsonl `eval_acc[0]`) and its position-1 acceptance (the eval report).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict

import torch

from dflash_train.data import StoreSet, split_eval
from dflash_train.objective import anchor_candidates

Sequence = tuple[list[int], list[bool]]  # token ids, loss mask (True on response tokens)


def anchors(mask: list[bool]) -> list[int]:
    """The trainer's anchor positions (t and t + 1 both response tokens), from t = 1 on (the trigram reads t - 1)."""
    cand = anchor_candidates(torch.tensor(mask, dtype=torch.bool)[None])[0]
    return [t for t in cand.nonzero()[:, 0].tolist() if t >= 1]


def build_tables(sequences: list[Sequence]) -> tuple[dict[int, Counter], dict[tuple[int, int], Counter]]:
    bigram: dict[int, Counter] = defaultdict(Counter)
    trigram: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for ids, mask in sequences:
        for t in anchors(mask):
            bigram[ids[t]][ids[t + 1]] += 1
            trigram[(ids[t - 1], ids[t])][ids[t + 1]] += 1
    return bigram, trigram


def slot1_accuracy(bigram: dict[int, Counter], trigram: dict[tuple[int, int], Counter],
                   sequences: list[Sequence]) -> dict[str, float]:
    """Share of response anchors whose next token is the table's top entry (an unseen anchor counts as a miss)."""
    hits = {"bigram": 0, "trigram": 0}
    n = 0
    for ids, mask in sequences:
        for t in anchors(mask):
            n += 1
            big = bigram.get(ids[t])
            tri = trigram.get((ids[t - 1], ids[t])) or big
            hits["bigram"] += bool(big) and big.most_common(1)[0][0] == ids[t + 1]
            hits["trigram"] += bool(tri) and tri.most_common(1)[0][0] == ids[t + 1]
    return {"anchors": n, **{k: v / n if n else float("nan") for k, v in hits.items()}}


def read_sequences(stores: StoreSet, indices: list[int]) -> list[Sequence]:
    samples = (stores[i] for i in indices)  # one read per sample: it loads the hidden states too
    return [(s["input_ids"].tolist(), s["loss_mask"].bool().tolist()) for s in samples]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", nargs="+", help="training store folder(s)")
    p.add_argument("--eval-store", default=None, help="a held-out store scored in full (e.g. the eval stage's)")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="the recipe's data.eval_fraction")
    p.add_argument("--eval-samples", type=int, default=16, help="the recipe's data.eval_samples")
    args = p.parse_args(argv)

    stores = StoreSet(args.store)
    train_idx, held = split_eval(stores.ids(), args.eval_fraction)
    train = read_sequences(stores, train_idx)
    bigram, trigram = build_tables(train)
    rows = {f"held-out split ({min(len(held), args.eval_samples)} samples)":
            slot1_accuracy(bigram, trigram, read_sequences(stores, held[:args.eval_samples])),
            f"training split ({len(train_idx)} samples)": slot1_accuracy(bigram, trigram, train)}
    if args.eval_store:
        ev = StoreSet([args.eval_store])
        rows[f"{args.eval_store} ({len(ev)} samples)"] = slot1_accuracy(
            bigram, trigram, read_sequences(ev, list(range(len(ev)))))
    print(f"n-gram tables from {len(train_idx)} training samples of {', '.join(args.store)}; "
          f"slot-1 accuracy (next token after a response anchor):\n")
    print("| scored on | anchors | bigram | trigram (bigram back-off) |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['anchors']} | {r['bigram']:.3f} | {r['trigram']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
