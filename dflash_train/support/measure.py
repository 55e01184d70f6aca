"""What the demo's probe (scripts/demo_probe.py) and the benchmarks (benchmarks/bench_train.py, bench_online.py)
measure on this machine, and the choice the demo's plan makes from it.

A training step of the DFlash objective as the trainer takes it per micro batch, on a drafter of a given shape with
random weights: sample anchors, drafter forward over all blocks, LM head + CE, backward, AdamW step (no DeepSpeed,
one process). `shape` is a namespace with the fields of bench_train's command line: hidden, layers, target_layers,
vocab, seq, anchors, block, batch, attention, head, head_chunk.

Then the choice between storing the target's states at capture and computing them in every training step
(`data.hidden_states: online`): `choose_hidden_states`, a pure decision from the measured rates, the epochs and the
disk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_train import objective as obj
from dflash_train.model.checkpoint import create_drafter
from dflash_train.model.configuration import DFlashConfig

DISK_SHARE = 0.8  # a store with states may take at most this share of the free disk


# --- a training step ----------------------------------------------------------------------------------------------


def shape_for(hidden: int) -> tuple[int, int, int, int]:
    """(heads, kv_heads, head_dim, intermediate) like the targets of that width (SmolLM2-135M, Qwen3-8B)."""
    known = {576: (9, 3, 64, 1536), 4096: (32, 8, 128, 12288), 2048: (16, 8, 128, 6144), 64: (4, 2, 16, 128)}
    if hidden in known:
        return known[hidden]
    head_dim = 64 if hidden < 1024 else 128
    heads = max(1, hidden // head_dim)
    return heads, max(1, heads // 4), head_dim, 3 * hidden


def make_drafter(args, device, dtype):
    """A drafter of `args`'s shape (hidden, layers, target_layers, vocab, seq, block) with random weights (seed 0)."""
    heads, kv, head_dim, inter = shape_for(args.hidden)
    num_target_layers = max(args.target_layers * 4, 8)
    config = DFlashConfig(
        hidden_size=args.hidden, intermediate_size=inter, num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=max(32768, args.seq * 2),
        vocab_size=args.vocab, num_target_layers=num_target_layers,
        target_layer_ids=list(range(1, 1 + 2 * args.target_layers, 2)), mask_token_id=args.vocab - 1,
        block_size=args.block)
    torch.manual_seed(0)
    return create_drafter(config).to(device=device, dtype=dtype)


def checkpointed_head_ce(hidden, head, labels, weights):
    """The public trainers' LM head + CE: full logits for every slot, checkpointed and recomputed in backward."""
    def f(h):
        logits = (h @ head.t()).float()
        return (F.cross_entropy(logits, labels, reduction="none") * weights).sum()

    return torch.utils.checkpoint.checkpoint(f, hidden, use_reentrant=False)


def step_fn(args, drafter, embed, head, batch, optimizer, step: int):
    """One training step on `batch` (anchors sampled with seed `step`); returns the sampled blocks."""
    blocks = obj.sample_anchors(batch["loss_mask"], args.anchors, args.block, torch.Generator().manual_seed(step))
    if args.head == "fused":
        out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=drafter.mask_token_id,
                              gamma=7.0, attention=args.attention, head_chunk_tokens=args.head_chunk)
        loss = out.loss
    else:
        labels, weights = obj.block_labels(batch["input_ids"], batch["loss_mask"], blocks, 7.0)
        hidden = obj.draft_hidden(drafter, embed, batch, blocks, drafter.mask_token_id, args.attention)
        w = weights.reshape(-1)
        loss = checkpointed_head_ce(hidden.reshape(-1, hidden.shape[-1]), head, labels.reshape(-1), w / w.sum())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    optimizer.step()
    return blocks


# --- stored states or online training -----------------------------------------------------------------------------


def break_even_epochs(rates: dict[str, float]) -> float:
    """Epochs from which storing the states costs less time than computing them online. Storing costs, once per
    token, the capture with states over the token-only capture: 1/capture_states_tok_s - 1/capture_tokens_tok_s;
    online costs, every epoch and token, 1/train_online_tok_s - 1/train_stored_tok_s. inf when online training is
    no slower; 0 when the capture with states is no slower."""
    once = 1.0 / rates["capture_states_tok_s"] - 1.0 / rates["capture_tokens_tok_s"]
    per_epoch = 1.0 / rates["train_online_tok_s"] - 1.0 / rates["train_stored_tok_s"]
    if per_epoch <= 0:
        return math.inf
    return max(0.0, once) / per_epoch


def choose_hidden_states(rates: dict[str, float], epochs: float, tokens: int | None = None,
                         disk_free_bytes: float | None = None) -> tuple[str, str]:
    """("stored" | "online", the reason in words) for training `epochs` epochs over a store of `tokens` tokens.

    `rates` (what benchmarks/bench_online.py's `probe_rates` measures): capture_states_tok_s and capture_tokens_tok_s
    (stored tokens/s of a capture with and without states), train_stored_tok_s and train_online_tok_s (trained
    tokens/s), state_bytes_per_token.
    A store with states that would take more than DISK_SHARE of the free disk is not an option; otherwise the
    faster of capture + `epochs` epochs of training wins (stored from `break_even_epochs` on; a tie stays stored)."""
    if tokens is not None and disk_free_bytes is not None:
        need = tokens * rates["state_bytes_per_token"]
        if need > DISK_SHARE * disk_free_bytes:
            return "online", (f"the states of {tokens:,} tokens need {need / 2**30:,.1f} GiB on disk, more than "
                              f"{DISK_SHARE:.0%} of the {disk_free_bytes / 2**30:,.1f} GiB free")
    even = break_even_epochs(rates)
    stored_s = 1.0 / rates["capture_states_tok_s"] + epochs / rates["train_stored_tok_s"]
    online_s = 1.0 / rates["capture_tokens_tok_s"] + epochs / rates["train_online_tok_s"]
    per_token = f"{1e3 * stored_s:.2f} ms per token stored, {1e3 * online_s:.2f} online"
    if epochs >= even:
        return "stored", (f"{epochs:g} epochs >= the break-even {even:.2f}: capturing the states once costs less than "
                          f"computing them every epoch ({per_token})")
    return "online", f"{epochs:g} epochs < the break-even {even:.2f} ({per_token})"
