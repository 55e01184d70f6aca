"""Does a drafter read its anchor token, and its context? A diagnostic for slow-learning drafters.

    python probes/anchor_use.py --store data/store/smollm2-demo-eval runs/A/drafter runs/B/drafter ...

For every held-out sample of the store, blocks start at up to --anchors response positions. Each drafter drafts
them twice: with the real anchor token in slot 0, and with the anchor replaced by a random token. A drafter that
uses the anchor changes its slot-1 draft; one that only reads the context (a bag of words of the conversation so
far) does not. A third draft of each block sees the context's tapped states zeroed (no context): what the drafter
gets from the target's states. Prints, per drafter: slot-1 and slot-5 accuracy against the target's own tokens, the
share of slot-1 drafts that change when the anchor is randomised, and slot-1 accuracy and changed drafts without the
context.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dflash_train import objective as obj
from dflash_train.model.checkpoint import load_drafter
from dflash_train.store.reader import open_store
from dflash_train.target import load_embedding_and_head


@torch.no_grad()
def anchor_use(drafter, embed: torch.Tensor, head: torch.Tensor, samples: list[dict], anchors: int,
               seed: int = 0) -> dict[str, float]:
    B, mask_id = drafter.block_size, drafter.mask_token_id
    g = torch.Generator().manual_seed(seed)
    changed = changed_blind = total = 0
    correct = torch.zeros(B)
    counted = torch.zeros(B)
    correct_blind = 0.0
    for i, s in enumerate(samples):
        batch = {k: s[k][None] for k in ("input_ids", "loss_mask", "hidden_states")}
        blocks = obj.sample_anchors(batch["loss_mask"], anchors, B, torch.Generator().manual_seed(seed + i))
        labels, weights = obj.block_labels(batch["input_ids"], batch["loss_mask"], blocks, 1.0)

        def drafts(inputs: dict) -> torch.Tensor:  # greedy drafts of every block, [num_blocks, B]
            hidden = obj.draft_hidden(drafter, embed, inputs, blocks, mask_id, "blockwise")
            return (hidden.float() @ head.t()).argmax(-1).view(-1, B)

        shuffled_ids = batch["input_ids"].clone()
        shuffled_ids[0, blocks.anchors[0]] = torch.randint(0, embed.shape[0], (blocks.num_blocks,), generator=g)
        pred = drafts(batch)
        pred_other = drafts({**batch, "input_ids": shuffled_ids})
        pred_blind = drafts({**batch, "hidden_states": torch.zeros_like(batch["hidden_states"])})
        ok = weights[0] > 0
        correct += ((pred == labels[0]) & ok).sum(0).float()
        correct_blind += float(((pred_blind[:, 1] == labels[0][:, 1]) & ok[:, 1]).sum())
        counted += ok.sum(0).float()
        keep = blocks.keep[0]
        changed += int((pred[keep, 1] != pred_other[keep, 1]).sum())
        changed_blind += int((pred[keep, 1] != pred_blind[keep, 1]).sum())
        total += int(keep.sum())
    acc = correct / counted.clamp(min=1)
    return {"acc_slot1": float(acc[1]), "acc_slot5": float(acc[5]), "slot1_changed": changed / max(1, total),
            "acc_slot1_no_context": correct_blind / max(1.0, float(counted[1])),
            "slot1_changed_no_context": changed_blind / max(1, total), "blocks": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafters", nargs="+", help="drafter folders")
    p.add_argument("--store", required=True, help="a held-out capture store (the target's own responses)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sample")
    args = p.parse_args(argv)
    store = open_store(args.store)
    samples = [store[i] for i in range(len(store))]
    embed, head = load_embedding_and_head(args.target, dtype=torch.float32)
    print("| drafter | slot-1 accuracy | slot-5 accuracy | slot-1 drafts changed by a random anchor | slot-1 accuracy "
          "without the context | slot-1 drafts changed without the context | blocks |")
    print("|---|---|---|---|---|---|---|")
    for folder in args.drafters:
        drafter = load_drafter(folder, dtype=torch.float32)[0].eval()
        r = anchor_use(drafter, embed, head, samples, args.anchors)
        print(f"| {folder} | {r['acc_slot1']:.3f} | {r['acc_slot5']:.3f} | {r['slot1_changed']:.1%} | "
              f"{r['acc_slot1_no_context']:.3f} | {r['slot1_changed_no_context']:.1%} | {r['blocks']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
