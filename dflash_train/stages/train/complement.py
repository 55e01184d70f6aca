"""What the free speculators already cover (recipe `objective.free_anchor_weight`): the training anchors where the
combined speculator (`engine.combined`) would verify a free block whose first draft is the target's next token, so
that the drafter's capacity can go to the steps they cannot cover.

A structured application repeats its keys, enums and phrasings across requests; the suffix tree serves those steps
from the answers the engine gave before, and prompt lookup serves the steps that repeat the request's own context.
The drafter is asked where neither does. Each training answer is replayed in the stores' order (the order its
requests came) through the same suffix tree the engine runs (`suffix.SuffixSource`, fed the answers before it, never
a later one) and prompt lookup; an anchor is covered where the rule (`lookup.CombinedRule`) takes the suffix tree's
block there and its first draft is right, or otherwise where lookup matched and its first draft is right. The
trainer draws covered anchors `free_anchor_weight` times as often as the others (data.anchor_weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dflash_train import objective as obj
from dflash_train.lookup import SUFFIX_SCORE, CombinedRule, lookup_match
from dflash_train.suffix import SuffixSource, replay_answer

RULE = CombinedRule(suffix=SUFFIX_SCORE)  # the combined speculator's rule as `--combined on` serves it


@dataclass
class Coverage:
    """Per sample (in the stores' order), a bool [S]: its anchors the free speculators cover; and the counts."""
    covered: list[torch.Tensor]
    anchors: int
    by_suffix: int
    by_lookup: int

    def summary(self) -> dict[str, float | int]:
        share = (lambda n: round(n / self.anchors, 4) if self.anchors else 0.0)
        return {"anchors": self.anchors, "covered": share(self.by_suffix + self.by_lookup),
                "by_suffix": share(self.by_suffix), "by_lookup": share(self.by_lookup)}


def free_coverage(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                  rule: CombinedRule = RULE) -> Coverage:
    """The anchors (objective.all_anchors) of each sample (input_ids, loss_mask), in request order, that the free
    speculators cover: the suffix tree's block where the rule takes it (at most block_size - 1 tokens, the drafter's
    longest K), else prompt lookup's where it matched; covered where that block's first draft is right."""
    tree = SuffixSource()
    covered, anchors, by_suffix, by_lookup = [], 0, 0, 0
    for n, (ids, mask) in enumerate(samples):
        tokens = ids.tolist()
        positions = obj.all_anchors(mask.bool()[None], block_size).anchors[0].tolist()
        row = torch.zeros(len(tokens), dtype=torch.bool)
        for a, draft in zip(positions, replay_answer(tree, f"train {n}", tokens, positions, block_size - 1),
                            strict=True):
            following = tokens[a + 1]
            if rule.picks_suffix(draft.score, len(draft.token_ids)):
                row[a] = hit = draft.token_ids[0] == following
                by_suffix += hit
            else:
                looked, matched = lookup_match(tokens[:a + 1], rule.k)
                row[a] = hit = matched > 0 and looked[:1] == [following]
                by_lookup += hit
        covered.append(row)
        anchors += len(positions)
    return Coverage(covered, anchors, by_suffix, by_lookup)
