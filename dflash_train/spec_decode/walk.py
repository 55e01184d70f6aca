"""The free speculators on answers already decoded: what prompt lookup (`lookup`) and the suffix tree (`suffix`) would
draft at each step, walked as greedy decoding walks the answer, without an engine. A step drafts from the prompt and
the answer so far, the target keeps the longest correct prefix of the draft and one token more, and the next step
drafts from there; tau is the tokens committed per verification step, over all steps, as the eval counts it (the
first answer token is the prefill's, not a step's). The suffix tree sees the answers in the order given, each one
after it is walked, as an engine's tree sees the answers it produced.

The demo's probe prices prompt lookup and suffix decoding by this walk over its capture sample's answers (tau, over
what a step of each costs in its timed runs): three timed prompts of a second each did not measure them (1.01x and
1.11x on them against 1.19x and 1.52x in the eval on the 2-core AVX2 host), and suffix decoding's tree held only the
probe's few answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_train.spec_decode.lookup import lookup_draft

FREE_METHODS = ("ngram", "suffix")  # vLLM's names: prompt lookup, suffix decoding


@dataclass(frozen=True)
class Walk:
    """A free speculator walked over answers: its verification steps and the tokens they committed, in all and per
    answer (answers of one token have no step and are left out)."""
    steps: int
    tokens: int
    per_answer: list[tuple[int, int]]

    @property
    def tau(self) -> float | None:
        """Tokens committed per verification step, over all steps (None: no step)."""
        return self.tokens / self.steps if self.steps else None


def accepted_length(draft: Sequence[int], ids: Sequence[int], at: int, end: int | None = None) -> int:
    """How many of `draft`'s tokens the target keeps at position `at` of `ids`: its longest prefix equal to
    ids[at:end] (a draft past `end`, the end of the answer it verifies, cannot be kept)."""
    n = 0
    for token, truth in zip(draft, ids[at:end]):
        if token != truth:
            break
        n += 1
    return n


def walk_answer(drafts: Sequence[Sequence[int]], answer: Sequence[int]) -> tuple[int, int]:
    """(steps, tokens committed) of greedy decoding through `answer` given the draft at every answer position
    (drafts[j]: the draft from the prompt and answer[:j]; drafts[0] unused: the prefill gives answer[0]); the steps
    are the positions greedy decoding visits (`objective.decoding_walk`)."""
    from dflash_train.objective import decoding_walk

    positions = list(range(1, len(answer)))
    committed = [min(accepted_length(drafts[j], answer, j) + 1, len(answer) - j) for j in positions]
    return len(decoding_walk(positions, committed)), max(0, len(answer) - 1)


def free_walk(method: str, requests: Sequence[tuple[Sequence[int], Sequence[int]]], k: int,
              max_answer_tokens: int | None = None) -> Walk:
    """`method` ("ngram" or "suffix") at speculation length k over `requests` ((prompt ids, answer ids), in the order
    an engine would see them), each answer cut at `max_answer_tokens`. The suffix tree is a fresh one (vLLM's
    defaults, `suffix.SuffixSettings`), fed as vLLM's proposer feeds it (`suffix.replay_answer`)."""
    if method not in FREE_METHODS:
        raise ValueError(f"free_walk: method {method!r} is not one of {FREE_METHODS}")
    tree = None
    if method == "suffix":
        from dflash_train.spec_decode.suffix import SuffixSource, replay_answer

        tree = SuffixSource()
    per_answer = []
    for i, (prompt, answer) in enumerate(requests):
        prompt, answer = list(prompt), list(answer[:max_answer_tokens])
        ids = prompt + answer
        if tree is not None:
            anchors = range(len(prompt), len(ids) - 1)  # context ids[:a + 1]: the prompt and answer[:a - len + 1]
            drafts = [[]] + [d.token_ids for d in replay_answer(tree, f"walk-{i}", ids, list(anchors), k)]
        else:
            drafts = [[]] + [lookup_draft(ids[:len(prompt) + j], k) for j in range(1, len(answer))]
        if len(answer) > 1:
            per_answer.append(walk_answer(drafts, answer))
    return Walk(steps=sum(s for s, _ in per_answer), tokens=sum(t for _, t in per_answer), per_answer=per_answer)
