"""Can the drafter learn to copy from its context, and does what it learns carry over to the target's own loops?

    python probes/copy_probe.py STORE --out DIR [--start drafters/smollm2-135m-instruct-general] [--steps 300]
        [--period 4-40] [--copy-weight 1] [--eval-every N]
    python probes/ngram_baseline.py STORE --eval-store HELD_OUT --drafter DIR/drafter    # on the real responses

Copy sequences are made of the store's own training responses: P + X + F + X + X, where X is a span of one response
(its length, the period, drawn per sequence from --period: a fixed N or a range LO-HI), P and F the starts of two
others (8-48 and 0-24 tokens); the target's states come from one prefill of the whole sequence, and only the last two
X carry loss. Finding what follows needs matching content where the period varies (a fixed one can be learnt as
"copy from N positions back").

Every step trains the starting drafter on a batch of copy sequences (loss weight --copy-weight; 0 = none) and on
one real sample of the store (weight 1), through the target's frozen embedding and full LM head and the project's
loss (objective.dflash_loss), AdamW with gradient clipping at 1, in fp32. Before and after, it prints the simulated
tau on held-out copy sequences (made the same way of the held-out split's responses); the drafter goes to
DIR/drafter, what made it and the losses to DIR/provenance.json. probes/ngram_baseline.py --drafter then tells
whether it copies on the target's real responses, where prompt lookup does.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from dflash_train import objective as obj
from dflash_train.stages.train.data import StoreSet, collate, split_eval
from dflash_train.errors import UserError
from dflash_train.support import runs

GAMMA = 5.0  # the adapt recipe's slot decay
SPAN_P, SPAN_F = (8, 48), (0, 24)  # the lengths of the text before the first X and between the first two


def parse_period(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit()) or not 2 <= int(lo) <= int(hi or lo):
        raise UserError(f"--period {text}: wants N or LO-HI with 2 <= LO <= HI")
    lo, hi = int(lo), int(hi or lo)
    return lo, hi


def responses(stores: StoreSet, indices: list[int], least: int) -> list[list[int]]:
    """The response tokens of these samples, those of at least `least` tokens."""
    out = []
    for i in indices:
        s = stores[i]
        r = s["input_ids"][s["loss_mask"].bool()].tolist()
        if len(r) >= least:
            out.append(r)
    return out


def copy_sequences(texts: list[list[int]], n: int, period: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    """n sequences P + X + F + X + X and where the loss starts (the second X)."""
    if len(texts) < 3:
        raise UserError(f"{len(texts)} responses long enough for --period {period[0]}-{period[1]}: copy sequences "
                        f"take spans of 3 different ones (a lower --period, or a store with longer responses)")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.sample(texts, 3)
        L = rng.randint(*period)
        at = rng.randint(0, len(a) - L)
        x, p, f = a[at:at + L], b[:rng.randint(*SPAN_P)], c[:rng.randint(*SPAN_F)]
        out.append((p + x + f + x + x, len(p) + L + len(f)))
    return out


def with_states(target, layers: list[int], seqs: list[tuple[list[int], int]]) -> list[dict[str, torch.Tensor]]:
    """Samples as the store gives them: ids, loss mask (the last two X), the tapped states of one prefill."""
    from dflash_train.states import prefill_capture
    from tqdm import tqdm

    out, pad = [], target.tokenizer.pad_token_id
    for at in tqdm(range(0, len(seqs), 16), desc="copy sequences' states", unit="batch of 16"):
        chunk = seqs[at:at + 16]
        for (ids, start), c in zip(chunk, prefill_capture(target.model, [s for s, _ in chunk], [s for _, s in chunk],
                                                          layers, pad)):
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[start:] = True
            out.append({"input_ids": torch.tensor(ids), "loss_mask": mask, "hidden_states": c.hidden_states.float()})
    return out


def copy_tau(drafter, embed: torch.Tensor, head: torch.Tensor, samples: list[dict[str, torch.Tensor]]) -> float:
    """Simulated tau at every anchor of the copy spans."""
    drafter.eval()
    lengths = torch.cat([obj.simulated_acceptance(drafter, embed, head, s) for s in samples])
    drafter.train()
    return lengths.float().mean().item()


def main(argv: list[str] | None = None) -> int:
    from dflash_train.model.checkpoint import load_drafter, save_drafter
    from dflash_train.provenance import write_provenance
    from dflash_train.target import load_embedding_and_head, load_target
    from tqdm import tqdm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="a store of the target's responses (with states)")
    p.add_argument("--out", required=True, help="where the drafter and provenance.json go")
    p.add_argument("--start", default="drafters/smollm2-135m-instruct-general", help="the drafter trained on")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--period", default="4-40", help="the copied span's length: N or LO-HI")
    p.add_argument("--copy-weight", type=float, default=1.0, help="the copy batch's loss weight (0: real data only)")
    p.add_argument("--copy-batch", type=int, default=2, help="copy sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="anchors per copy sequence (32 on the real sample)")
    p.add_argument("--samples", type=int, default=256, help="copy sequences made for training")
    p.add_argument("--eval-samples", type=int, default=16, help="held-out copy sequences")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-fraction", type=float, default=0.02, help="the recipe's data.eval_fraction")
    p.add_argument("--eval-every", type=int, default=0, help="held-out copy tau every N steps too (0: at the end)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    period = parse_period(args.period)
    torch.manual_seed(args.seed)

    stores = StoreSet([args.store])
    train_idx, held_idx = split_eval(stores.ids(), args.eval_fraction)
    least = period[1] + SPAN_P[1]
    target = load_target(args.target, dtype=torch.float32)
    layers = list(stores.manifest["target_layer_ids"])
    started = time.perf_counter()
    train = with_states(target, layers, copy_sequences(responses(stores, train_idx, least), args.samples, period,
                                                       args.seed))
    held = with_states(target, layers, copy_sequences(responses(stores, held_idx, least), args.eval_samples,
                                                      period, args.seed + 1))
    del target
    print(f"{len(train)} + {len(held)} copy sequences, period {args.period}, states in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    embed, head = load_embedding_and_head(args.target, dtype=torch.float32)
    drafter, config = load_drafter(args.start, dtype=torch.float32)
    B = drafter.block_size
    before = copy_tau(drafter, embed, head, held)
    print(f"step 0: held-out copy tau {before:.3f}", flush=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    history = []
    for step in tqdm(range(1, args.steps + 1), desc="copy probe", unit="step"):
        optimizer.zero_grad()
        picks = torch.randint(0, len(train), (args.copy_batch,), generator=g).tolist()
        real = stores[train_idx[int(torch.randint(0, len(train_idx), (1,), generator=g))]]
        losses = {}
        for name, samples, anchors, weight in (("copy", [train[i] for i in picks], args.anchors, args.copy_weight),
                                               ("real", [real], 2 * args.anchors, 1.0)):
            if weight == 0:
                continue
            # one sample a row, right-padded (padding carries no loss and lies after every anchor's context)
            batch = collate([[s] for s in samples], max(len(s["input_ids"]) for s in samples))
            blocks = obj.sample_anchors(batch["loss_mask"], anchors, B, g)
            out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=drafter.mask_token_id,
                                  gamma=GAMMA, attention="blockwise")
            (weight * out.loss).backward()
            losses[name] = round(out.loss.item(), 4)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        history.append({"step": step, **losses})
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            history[-1]["copy_tau"] = copy_tau(drafter, embed, head, held)
            tqdm.write(f"step {step}: held-out copy tau {history[-1]['copy_tau']:.3f}")
    after = copy_tau(drafter, embed, head, held)
    print(f"step {args.steps}: held-out copy tau {after:.3f} (from {before:.3f})", flush=True)
    out = Path(args.out)
    save_drafter(drafter, config, out / "drafter")
    write_provenance(out, {"script": "probes/copy_probe.py", "args": vars(args), "start": args.start},
                     copy_tau_before=before, copy_tau_after=after, history=history)
    print(f"drafter: {out / 'drafter'}; next: python probes/ngram_baseline.py {args.store} --eval-store HELD_OUT "
          f"--drafter {out / 'drafter'}")
    return 0


if __name__ == "__main__":
    runs.script_main(main)
