"""The draft vocabulary a trained drafter ships with (recipe `drafter.draft_vocab_size`): the target ids its
training answers use most, then the ids their prompts use most (what an answer copies comes from there), the
target's stop tokens always in.

A drafter scores its block with the target's LM head, and on a small target that head holds more weights than the
drafter's layers. vLLM reads a draft vocabulary (config.json's `draft_vocab_size`, the head's rows as `lm_head.weight`
and `d2t`: checkpoint.draft_vocabulary writes them); drafting only the ids a service's answers use made a vLLM step
6-9% cheaper on the demo's drafters, tau unchanged (BENCHMARKS "What the drafter's LM head costs a step"). The
trainer chooses them before its first step and scores only their rows (the head is most of a training step's work on
a CPU), a label outside them without loss (objective.draft_rows); the export ships the rows. A token outside them
cannot be drafted (the target still decodes it): how many of the training answers' tokens they cover is recorded.
"""

from __future__ import annotations

from collections import Counter

from dflash_train.model.checkpoint import DraftVocabulary
from dflash_train.stages.train.data import StoreSet


def token_counts(stores: StoreSet, indices: list[int]) -> tuple[Counter, Counter]:
    """How often each token id occurs in the answers (loss-masked positions) and in the rest (prompts) of the samples
    that train (`indices` into the stores: held-out samples and replay samples not chosen are not counted), each
    sample counted as often as its weight (the copies dedup folded into it)."""
    answers, prompts, train, start = Counter(), Counter(), set(indices), 0
    for store in stores.stores:
        for j, (ids, mask, weight) in enumerate(store.tokens()):
            if start + j not in train:
                continue
            for counts, part in ((answers, ids[mask]), (prompts, ids[~mask])):
                for token, n in Counter(part.tolist()).items():
                    counts[token] += n * weight
        start += len(store)
    return answers, prompts


def choose(answers: Counter, prompts: Counter, size: int, always: list[int]) -> list[int]:
    """At most `size` ids, sorted: `always`, then the ids the answers use most, then those the prompts use most
    (fewer than `size` where the stores use fewer ids)."""
    ranked = dict.fromkeys([*always, *(t for t, _ in answers.most_common()), *(t for t, _ in prompts.most_common())])
    return sorted(list(ranked)[:size])


def choose_draft_vocabulary(stores: StoreSet, indices: list[int], size: int, always: list[int]) -> DraftVocabulary:
    """The ids (`choose`) of the samples that train (`indices`) and what they cover: the share of their answers'
    tokens inside them."""
    answers, prompts = token_counts(stores, indices)
    ids = choose(answers, prompts, size, always)
    inside = set(ids)
    total = sum(answers.values())
    covered = sum(n for token, n in answers.items() if token in inside)
    return {"ids": ids, "size": len(ids), "asked": size, "answer_ids": len(answers),
            "answer_tokens_covered": round(covered / total, 4) if total else None,
            "chosen_from": "the training answers' most used ids, then their prompts', the stop tokens always in"}
