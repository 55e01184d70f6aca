"""How far is a drafter from a lookup table? Slot-1 accuracy of n-gram tables built from a training store, and the
tau of copying from the context (prompt lookup).

    python probes/ngram_baseline.py data/store/smollm2-demo [--eval-store data/store/smollm2-demo-eval] [--k 1,15]
        [--drafter runs/smollm2-demo/drafter]

Builds a bigram table (anchor -> next token) and a trigram table (previous token, anchor -> next token, backing off
to the bigram) from the response tokens of the store's training split, then reports how often the table's most
frequent entry is the target's token at anchor + 1, over every held-out response anchor: on the store's own held-out
split (its first --eval-samples samples, the ones the trainer's simulated-tau eval reads), on the training split
itself (what memorising the data gives), and on every sample of --eval-store. Compare with a drafter's slot-1
accuracy (metrics.jsonl `eval_acc[0]`) and its position-1 acceptance (the eval report).

Prompt lookup needs no table: at each verification step it drafts the K tokens that followed the latest earlier
occurrence of the context's last n tokens (n = 3, else 2, else 1; prompt and response so far), as vLLM's `ngram`
speculator does, and the target keeps the longest correct prefix plus one token of its own. Its tau at K (tokens
per step, as a drafter's) measures how much of the target's text repeats its context: loops, quotes, code copied
from the prompt. A DFlash drafter reads the same context through the target's states and can learn to copy.

With --drafter, the drafter and prompt lookup draft a block at every response anchor of the held-out samples
(--eval-store, else the held-out split), as the trainer's simulated tau does: their mean acceptance lengths, the
drafter's where copying works (lookup accepts 3 or more tokens there) and elsewhere, and the mean of the better of
the two at each anchor, what a drafter that also copied would reach.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable

import torch

from dflash_train.stages.train.data import StoreSet, split_eval
from dflash_train.spec_decode.lookup import lookup_draft, lookup_match
from dflash_train.spec_decode.walk import accepted_length
from dflash_train.objective import anchor_candidates

Sequence = tuple[list[int], list[bool]]  # token ids, loss mask (True on response tokens)


def anchors(mask: list[bool], first: int = 1) -> list[int]:
    """The trainer's anchor positions (t and t + 1 both response tokens), from t = `first` on (the trigram reads
    t - 1)."""
    cand = anchor_candidates(torch.tensor(mask, dtype=torch.bool)[None])[0]
    return [t for t in cand.nonzero()[:, 0].tolist() if t >= first]


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


def lookup_tau(sequences: list[Sequence], k: int) -> dict[str, float]:
    """Prompt lookup at speculation length k on each sequence's response: tokens per verification step, the first
    response token being the anchor of the first step (the prefill wrote it). Mean over sequences, and over all
    steps."""
    taus, tokens, steps = [], 0, 0
    for ids, mask in sequences:
        response = [t for t, m in enumerate(mask) if m]
        if len(response) < 2:
            continue
        i, end, n_steps = response[0] + 1, response[-1] + 1, 0  # ids[:i] is known; ids[i:end] is to decode
        while i < end:
            i += min(accepted_length(lookup_draft(ids[:i], k), ids, i, end) + 1, end - i)
            n_steps += 1
        taus.append((end - response[0] - 1) / n_steps)
        tokens, steps = tokens + end - response[0] - 1, steps + n_steps
    return {"sequences": len(taus), "tau": sum(taus) / len(taus) if taus else float("nan"),
            "tau_steps": tokens / steps if steps else float("nan")}


def segment_ends(mask: list[bool]) -> list[int]:
    """end[t]: the first non-response position from t on (a draft past it cannot be verified)."""
    end = [len(mask)] * (len(mask) + 1)
    for t in range(len(mask) - 1, -1, -1):
        end[t] = end[t + 1] if mask[t] else t
    return end


def lookup_lengths(ids: list[int], mask: list[bool], block_size: int, matched: list[int] | None = None) -> list[int]:
    """Prompt lookup's acceptance length at every trainer anchor (as objective.simulated_acceptance counts a
    drafter's: 1 + the leading drafts that equal the target's response tokens), drafting block_size - 1 tokens;
    with `matched`, a list, the length of the suffix lookup matched at each anchor is appended to it."""
    segment_end = segment_ends(mask)
    lengths = []
    for a in anchors(mask, first=0):
        draft, n = lookup_match(ids[:a + 1], block_size - 1)
        lengths.append(1 + accepted_length(draft, ids, a + 1, segment_end[a + 1]))
        if matched is not None:
            matched.append(n)
    return lengths


def drafter_against_lookup(drafter, embed: torch.Tensor, head: torch.Tensor, samples: list[dict]) -> dict[str, float]:
    """Acceptance lengths of the drafter (objective.simulated_acceptance) and of prompt lookup at the same anchors:
    their means, the drafter's where lookup accepts 3 or more tokens (copying works there) and elsewhere, the share
    of such anchors, and the mean of the better of the two."""
    from dflash_train.objective import simulated_acceptance

    pairs = []
    for sample in samples:
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].bool().tolist()
        drafted = simulated_acceptance(drafter, embed, head, sample).tolist()
        looked = lookup_lengths(ids, mask, drafter.block_size)
        assert len(drafted) == len(looked), (len(drafted), len(looked))
        pairs += zip(drafted, looked)
    copy = [d for d, c in pairs if c >= 3]
    rest = [d for d, c in pairs if c < 3]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return {"anchors": len(pairs), "drafter": mean([d for d, _ in pairs]), "lookup": mean([c for _, c in pairs]),
            "copy_share": len(copy) / len(pairs) if pairs else float("nan"), "drafter_where_copying": mean(copy),
            "drafter_elsewhere": mean(rest), "better_of_both": mean([max(d, c) for d, c in pairs])}


def sequences(samples: Iterable[dict]) -> list[Sequence]:
    """Token ids and loss masks of store samples (a generator of them keeps one sample's states in memory at a
    time: each read loads the hidden states too)."""
    return [(s["input_ids"].tolist(), s["loss_mask"].bool().tolist()) for s in samples]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", nargs="+", help="training store folder(s)")
    p.add_argument("--eval-store", default=None, help="a held-out store scored in full (e.g. the eval stage's)")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="the recipe's data.eval_fraction")
    p.add_argument("--eval-samples", type=int, default=16, help="the recipe's data.eval_samples")
    p.add_argument("--k", default="1,15", help="speculation lengths for prompt lookup's tau")
    p.add_argument("--drafter", default=None, help="a drafter folder to set against prompt lookup, anchor by anchor")
    p.add_argument("--target", default="smollm2-135m-instruct", help="the target whose embedding and head it uses")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.k.split(",")]

    stores = StoreSet(args.store)
    train_idx, held = split_eval(stores.ids(), args.eval_fraction)
    train = sequences(stores[i] for i in train_idx)
    bigram, trigram = build_tables(train)
    held_out = [stores[i] for i in held[:args.eval_samples]]
    scored = {f"held-out split ({len(held_out)} samples)": sequences(held_out),
              f"training split ({len(train_idx)} samples)": train}
    if args.eval_store:
        ev = StoreSet([args.eval_store])
        held_out = [ev[i] for i in range(len(ev))]  # what --drafter scores
        scored[f"{args.eval_store} ({len(ev)} samples)"] = sequences(held_out)
    rows = {name: slot1_accuracy(bigram, trigram, seqs) for name, seqs in scored.items()}
    print(f"n-gram tables from {len(train_idx)} training samples of {', '.join(args.store)}; "
          f"slot-1 accuracy (next token after a response anchor):\n")
    print("| scored on | anchors | bigram | trigram (bigram back-off) |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['anchors']} | {r['bigram']:.3f} | {r['trigram']:.3f} |")
    print("\nprompt lookup (copy from the context), tau mean over sequences [over all steps]:\n")
    print("| scored on | " + " | ".join(f"K = {k}" for k in ks) + " |\n|---|" + "---|" * len(ks))
    for name, seqs in scored.items():
        cells = [lookup_tau(seqs, k) for k in ks]
        print(f"| {name} | " + " | ".join(f"{c['tau']:.3f} [{c['tau_steps']:.3f}]" for c in cells) + " |")
    if args.drafter:
        from dflash_train.model.checkpoint import load_drafter
        from dflash_train.target import load_embedding_and_head

        embed, head = load_embedding_and_head(args.target, dtype=torch.float32)
        drafter = load_drafter(args.drafter, dtype=torch.float32)[0].eval()
        r = drafter_against_lookup(drafter, embed, head, held_out)
        print(f"\n{args.drafter} and prompt lookup, a block at each of {r['anchors']} held-out anchors, mean "
              f"acceptance length:\n")
        print("| drafter | prompt lookup | drafter where lookup copies 3+ tokens (share of anchors) | drafter "
              "elsewhere | the better of the two |\n|---|---|---|---|---|")
        print(f"| {r['drafter']:.3f} | {r['lookup']:.3f} | {r['drafter_where_copying']:.3f} ({r['copy_share']:.1%}) "
              f"| {r['drafter_elsewhere']:.3f} | {r['better_of_both']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
