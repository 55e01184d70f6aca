"""The anchors the free speculators already cover (stages/train/complement.py), replayed in request order, and the
anchor weights that put the drafter's training where they miss (data.anchor_weights)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.engine.install import suffix_problem

pytestmark = pytest.mark.skipif(suffix_problem() is not None, reason=str(suffix_problem()))


def sample(prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(prompt + answer), torch.tensor([False] * len(prompt) + [True] * len(answer))


def test_an_answer_that_repeats_an_earlier_one_is_covered_by_the_suffix_tree_and_the_first_one_is_not():
    from dflash_train.lookup import CombinedRule
    from dflash_train.stages.train.complement import free_coverage

    answer = [20, 21, 22, 23, 24, 25, 26, 27]
    rule = CombinedRule(suffix=1.0)
    coverage = free_coverage([sample([1, 2], answer), sample([3, 4], answer)], block_size=8, rule=rule)
    first, second = coverage.covered
    assert not first.any()  # nothing before it, and nothing in it repeats
    # the second: the tree holds the first answer's continuation; its draft is at most as long as its match
    # (vLLM's max_spec_factor 1) and each token half as likely (the second answer so far matches too, and stops
    # there), so its score reaches the rule's 1 at anchors 3 to 7 (2 to 4 tokens drafted), not at 2 nor 8 (one)
    assert second.tolist() == [False] * 3 + [True] * 5 + [False] * 2  # position 9 is no anchor
    assert coverage.anchors == 14 and coverage.by_suffix == int(second.sum()) and coverage.by_lookup == 0
    looping = free_coverage([sample([9], [5, 6, 5, 6, 5, 6])], block_size=8, rule=CombinedRule())  # no tree
    assert looping.covered[0].tolist() == [False, False, False, True, True, True, False]  # lookup copies the loop
    assert looping.by_lookup == 3 and looping.summary()["covered"] == pytest.approx(3 / 5)


def test_covered_anchors_are_drawn_free_anchor_weight_times_as_often_padding_never_covered():
    from dflash_train.stages.train.data import anchor_weights, collate

    H = 4
    rows = [[{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([False, True, True]),
              "hidden_states": torch.zeros(3, H), "free_covered": torch.tensor([False, True, False])}],
            [{"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([False, True]),
              "hidden_states": torch.zeros(2, H), "free_covered": torch.tensor([False, True])}]]
    batch = collate(rows, 16)
    assert batch["free_covered"].tolist() == [[False, True, False], [False, True, False]]
    assert anchor_weights(batch, 1.0, 1.0) is None  # uniform
    assert anchor_weights(batch, 1.0, 0.25).tolist() == [[1.0, 0.25, 1.0], [1.0, 0.25, 1.0]]
    without = [[{k: v for k, v in s.items() if k != "free_covered"} for s in row] for row in rows]
    assert "free_covered" not in collate(without, 16)
