"""The suffix tree as a source of drafts (suffix.SuffixSource: arctic-inference's, fed as vLLM's suffix proposer
feeds it) and its offline replay in request order (suffix.replay_answer)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dflash_train.spec_decode.suffix import suffix_problem

pytestmark = pytest.mark.skipif(suffix_problem() is not None, reason=str(suffix_problem()))


def test_a_request_is_drafted_from_an_earlier_answer_and_its_own_prompt_and_nothing_else():
    from dflash_train.spec_decode.suffix import SuffixSource

    tree = SuffixSource()
    assert tree.draft("a", [1, 2, 3], [], [1, 2, 3], 7).token_ids == []  # a partial prefill: nothing fed
    assert tree.cached() == set()
    assert tree.draft("a", [1, 2, 3], [20], [1, 2, 3, 20], 7).token_ids == []  # nothing repeats yet
    tree.draft("a", [1, 2, 3], [21, 22, 23, 24], [1, 2, 3, 20, 21, 22, 23, 24], 7)
    tree.finish_others(["b"])  # "a" left the batch: stopped, its answer stays cached
    assert tree.cached() == {"a"} and set(tree.cache.active_requests) == set()
    draft = tree.draft("b", [9, 9], [20, 21], [9, 9, 20, 21], 7)  # b's answer starts as a's did
    # at most max_spec_factor (vLLM's 1) x the match's length; its score the tokens it expects accepted: b's own
    # answer so far also ends in 20 21, followed by nothing yet, so each token is half as likely
    assert draft.token_ids == [22, 23] and draft.match_len == 2 and draft.score == pytest.approx(1.0)
    longer = tree.draft("b", [9, 9], [22], [9, 9, 20, 21, 22], 7)
    assert longer.token_ids == [23, 24] and longer.match_len == 3  # a's answer ends after 24
    own = tree.draft("c", [5, 6, 7, 8], [5, 6], [5, 6, 7, 8, 5, 6], 2)  # its own prompt, at most k
    assert own.token_ids == [7, 8]
    late = tree.draft("d", [1], [20], [1, 20], 7, max_model_len=4)  # room for 2 more tokens: 1 draft at most
    assert len(late.token_ids) == 1


def test_replaying_answers_in_request_order_drafts_each_anchor_as_any_walk_would_and_holds_only_earlier_answers():
    from dflash_train.spec_decode.suffix import SuffixSource, replay_answer

    rng = random.Random(0)
    answers = [[rng.randrange(12) for _ in range(40)] for _ in range(4)]
    samples = [[100 + i] * 4 + answer for i, answer in enumerate(answers)]

    def replay(every: int) -> tuple[list[list], list[set]]:
        tree, drafts, held = SuffixSource(), [], []
        for i, ids in enumerate(samples):
            held.append(tree.cached())
            anchors = list(range(4, len(ids) - 1, every))
            drafts.append([(d.token_ids, round(d.score, 6)) for d in replay_answer(tree, f"r{i}", ids, anchors, 7)])
        return drafts, held

    one, held = replay(1)
    three, _ = replay(3)  # the tree fed 3 tokens a step: the same draft at every anchor both visit
    assert all(one[i][3 * j] == three[i][j] for i in range(4) for j in range(len(three[i])))
    assert held == [set(), {"r0"}, {"r0", "r1"}, {"r0", "r1", "r2"}]  # never an answer not replayed yet
    assert any(tokens for sample in one[1:] for tokens, _ in sample)  # the earlier answers do draft
    assert np.mean([len(t) for t, _ in one[3]]) > np.mean([len(t) for t, _ in one[0]])
