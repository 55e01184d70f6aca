"""Validation during training: the held-out samples' loss and simulated acceptance length, as the trainer logs
them in metrics.jsonl (its "eval" rows)."""

from __future__ import annotations

import math
from typing import TypedDict

import torch

from dflash_train import objective as obj
from dflash_train.stages.train.data import OnlineStates, anchor_generator, collate
from dflash_train.stages.train.recipe import Recipe
from dflash_train.store.format import Sample


class HeldOutMetrics(TypedDict, total=False):
    """What one validation measured (`held_out_metrics`); the trainer holds {} before its first."""
    eval_loss: float
    eval_sim_tau: float
    eval_anchor_tau: float
    eval_acc: list[float | None]  # [k-1]: the share of slot k's drafts that are right
    eval_anchors: int
    eval_samples: int


@torch.no_grad()
def held_out_metrics(drafter, embed: torch.Tensor, head: torch.Tensor, samples: list[Sample], recipe: Recipe,
                     online: OnlineStates | None, device: torch.device, mask_id: int, attention: str,
                     draft_ids: torch.Tensor | None = None) -> HeldOutMetrics:
    """Held-out loss (anchors drawn with a fixed seed) and simulated acceptance length `eval_sim_tau` (a block
    at every anchor, objective.simulated_acceptance, walked as greedy decoding walks the answer:
    objective.decoded_steps; per sample the mean over its steps, then over samples, as the eval counts tau),
    with `eval_anchor_tau`, the mean over every anchor (this project's eval_sim_tau before 2026-12-05, which
    overstates tau where easy and hard stretches alternate). `drafter` is the plain module (not DeepSpeed's
    wrapper), left in the train/eval mode it was in. `draft_ids`: `head` is the rows of a draft vocabulary of
    these target ids (objective.draft_rows)."""
    was_training = drafter.training
    drafter.eval()
    B = recipe.drafter.block_size
    loss_sum, weight_sum = 0.0, 0.0
    correct, counted = torch.zeros(B), torch.zeros(B)
    lengths, walked = [], []
    for i, sample in enumerate(samples):
        rows = [[sample]] if online is None else online.add([[sample]])
        batch = {k: v.to(device) for k, v in collate(rows, recipe.data.max_length).items()}
        blocks = obj.sample_anchors(batch["loss_mask"], recipe.objective.num_anchors, B,
                                    anchor_generator(recipe.seed, -1, i, 0))
        out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=mask_id,
                              gamma=recipe.decay_gamma, attention=attention,
                              head_chunk_tokens=recipe.objective.head_chunk_tokens,
                              label_rows=None if draft_ids is None else obj.draft_rows(draft_ids, embed.shape[0]))
        w = float(out.weight_sum)
        if w > 0:
            loss_sum += float(out.loss) * w
            weight_sum += w
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        trimmed = {k: batch[k][0] for k in ("input_ids", "loss_mask", "hidden_states")}
        lengths.append(obj.simulated_acceptance(drafter, embed, head, trimmed, B, mask_id,
                                                attention=attention, draft_ids=draft_ids))
        if steps := obj.decoded_steps(trimmed, lengths[-1].tolist(), B):
            walked.append(sum(steps) / len(steps))
    drafter.train(was_training)
    all_lengths = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long)
    return {
        "eval_loss": loss_sum / weight_sum if weight_sum else math.nan,
        "eval_sim_tau": sum(walked) / len(walked) if walked else math.nan,
        "eval_anchor_tau": float(all_lengths.float().mean()) if all_lengths.numel() else math.nan,
        "eval_acc": [round(float(c / n), 4) if n else None for c, n in zip(correct[1:], counted[1:])],
        "eval_anchors": int(all_lengths.numel()),
        "eval_samples": len(samples),
    }
