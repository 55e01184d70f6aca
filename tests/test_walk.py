"""The free speculators walked over answers already decoded (spec_decode.walk): greedy decoding's steps through an
answer, prompt lookup's drafts from the request's own context, the suffix tree's from earlier answers only."""

from __future__ import annotations

import random

import pytest

from dflash_train.spec_decode.suffix import suffix_problem
from dflash_train.spec_decode.walk import free_walk, walk_answer


def test_a_step_commits_the_drafts_correct_prefix_and_one_token_more_never_past_the_answer():
    answer = [10, 11, 12, 13, 14, 15]
    # at 1: [11, 12, 99] keeps 2 (+1: 11 12 13 committed, next at 4); at 4: [14, 15, 16] keeps 2, but only 1 is left
    drafts = [[], [11, 12, 99], [], [], [14, 15, 16], []]
    assert walk_answer(drafts, answer) == (2, 5)
    assert walk_answer([[]] * 6, answer) == (5, 5)  # no draft: one token a step
    assert walk_answer([[]], [7]) == (0, 0)  # the prefill's token alone: no step


def test_prompt_lookup_walks_an_answer_that_copies_its_prompt_faster_than_new_text():
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 2000) for _ in range(40)]
    copied = free_walk("ngram", [(prompt, prompt[10:40])], k=4)
    new = free_walk("ngram", [(prompt, list(range(30)))], k=4)
    assert new.tau == 1.0 and new.steps == 29
    assert copied.tokens == 29 and copied.tau > 3.5  # K + 1 a step after its first match
    cut = free_walk("ngram", [(prompt, prompt[10:40])], k=4, max_answer_tokens=10)
    assert cut.tokens == 9


@pytest.mark.skipif(suffix_problem() is not None, reason=str(suffix_problem()))
def test_the_suffix_tree_drafts_from_the_answers_before_a_request_never_from_its_own_future():
    rng = random.Random(1)
    answer = rng.sample(range(100, 1000), 60)  # no token twice: nothing in it repeats
    first = free_walk("suffix", [([1, 2, 3], answer)], k=8)
    assert first.tau == pytest.approx(1.0)  # nothing before it, and it never repeats itself
    again = free_walk("suffix", [([1, 2, 3], answer), ([4, 5, 6], answer)], k=8)
    assert again.per_answer[0] == first.per_answer[0]
    steps, tokens = again.per_answer[1]
    assert tokens == 59 and steps < 59 / 4  # the second answer repeats the first: long drafts accepted
    with pytest.raises(ValueError, match="not one of"):
        free_walk("eagle", [([1], [2, 3])], k=2)
