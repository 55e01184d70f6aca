"""Which keys each block query sees: the blocks of a training row, THE visibility rule, and its three backends.

Training packs the N blocks of a row into one forward: queries [block_0 | ... | block_N-1] (N*B), keys
[context 0..S-1 | block_0 | ... | block_N-1] (S + N*B). The rule (`visible`):

    a query of block j sees the context strictly before its anchor a_j, from the start of its own sample (packed
    rows) or of its context window (the trainer's warm-up) on, [lo_j, a_j); all B slots of block j; no other block.

That is exactly what the drafter sees at inference: the target has verified tokens up to and including a_j, but the
drafter's context holds states only for positions before it, since the anchor's own state is produced by the same
target forward that verifies the next block. Seeing position a_j itself is the known leak.

Each backend is a mask built from `visible` plus the attention function that reads it (the model takes both:
`model(..., attention_mask=mask, attention_fn=fn)`); `attention_for` picks them by name:
  sdpa       a dense bool mask [b, 1, N*B, S + N*B] and torch's SDPA (modeling_dflash.sdpa_attention);
  flex       a FlexAttention BlockMask (tiles no query sees are skipped) and compiled flex_attention (CUDA);
  blockwise  the visibility of groups of consecutive blocks over only the context they can reach, and plain
             matmuls over [context | own block] (the CPU path: no dense mask, about half the scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from torch.nn.attention.flex_attention import create_block_mask
except ImportError:  # torch without FlexAttention: the dense and blockwise paths still work
    create_block_mask = None


@dataclass
class Blocks:
    """The N blocks of each of b rows: anchors sorted ascending, padding blocks (keep False) last."""
    anchors: torch.Tensor  # [b, N] long: position of each block's anchor in its row (0 for padding blocks)
    keep: torch.Tensor  # [b, N] bool: False = a padding block (fewer candidates than N); it has no loss
    ctx_start: torch.Tensor  # [b, N] long: first context position the block may see (its sample's start)
    block_size: int
    # None: a block sees its whole context; W: only the last W positions before its anchor (0 = none). The
    # trainer's context warm-up narrows the window; inference always sees the whole context.
    context_window: int | None = None

    @property
    def ctx_lo(self) -> torch.Tensor:
        """[b, N]: the context a block sees is [ctx_lo, anchor)."""
        if self.context_window is None:
            return self.ctx_start
        return torch.maximum(self.ctx_start, self.anchors - self.context_window)

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]


def make_blocks(anchors: torch.Tensor, keep: torch.Tensor, block_size: int,
                doc_start: torch.Tensor | None = None) -> Blocks:
    """Blocks at `anchors` [b, N]; doc_start [b, S] (packed rows) gives each block the start of its sample."""
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    ctx_start = torch.zeros_like(anchors) if doc_start is None else doc_start.gather(1, anchors)
    return Blocks(anchors=anchors, keep=keep, ctx_start=ctx_start, block_size=block_size)


def visible(q_block, kv, ctx_lo, anchor, seq_len: int, block_size: int):
    """THE rule, for a query of block `q_block` whose context window is [ctx_lo, anchor) and a key index `kv` over
    [context 0..seq_len-1 | blocks, block_size slots each]: True iff the key is context inside the window or a slot
    of the query's own block. Arguments broadcast (tensors), so every backend evaluates this one expression."""
    is_context = kv < seq_len
    in_window = (kv >= ctx_lo) & (kv < anchor)
    own_block = (kv - seq_len) // block_size == q_block
    return (is_context & in_window) | (~is_context & own_block)


# --- sdpa: a dense mask ------------------------------------------------------------------------------------------


def dense_mask(blocks: Blocks, seq_len: int) -> torch.Tensor:
    """[b, 1, N*B, S + N*B] bool, True = may attend (for SDPA)."""
    B, dev = blocks.block_size, blocks.anchors.device
    q_len = blocks.num_blocks * B
    q_block = (torch.arange(q_len, device=dev) // B)[None, :, None]  # [1, Q, 1]
    kv = torch.arange(seq_len + q_len, device=dev)[None, None, :]  # [1, 1, K]
    lo = blocks.ctx_lo.repeat_interleave(B, dim=1)[:, :, None]  # [b, Q, 1]
    anchor = blocks.anchors.repeat_interleave(B, dim=1)[:, :, None]
    return visible(q_block, kv, lo, anchor, seq_len, B)[:, None]


# --- flex: a FlexAttention BlockMask -----------------------------------------------------------------------------


def block_mask_mod(blocks: Blocks, seq_len: int):
    """The rule as a FlexAttention mask_mod over keys [context | blocks]."""
    anchors, ctx_lo, B = blocks.anchors, blocks.ctx_lo, blocks.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // B
        return visible(j, kv_idx, ctx_lo[b, j], anchors[b, j], seq_len, B)

    return mask_mod


def flex_block_mask(blocks: Blocks, seq_len: int):
    """A FlexAttention BlockMask (CUDA training path); tiles that no query can see are skipped entirely."""
    if create_block_mask is None:
        raise RuntimeError("this torch has no FlexAttention; use attention: sdpa")
    b, n = blocks.anchors.shape
    q_len = n * blocks.block_size
    return create_block_mask(block_mask_mod(blocks, seq_len), B=b, H=None, Q_LEN=q_len, KV_LEN=seq_len + q_len,
                             device=blocks.anchors.device)


_compiled_flex = None


def flex_attention(q, k, v, block_mask, scale: float) -> torch.Tensor:
    """FlexAttention with a BlockMask, through a compiled kernel (eager FlexAttention materialises every score,
    which defeats its purpose)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention as eager_flex

        _compiled_flex = torch.compile(eager_flex)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


# --- blockwise: grouped visibility and plain matmuls (the CPU path) ----------------------------------------------


@dataclass
class BlockwiseMask:
    """The rule for consecutive groups of blocks. Blocks come sorted by anchor, so a group of `group` blocks only
    needs the context up to its furthest anchor: about N*B*(S/2 + B) scores in all instead of N*B*(S + N*B)."""
    blocks: Blocks
    seq_len: int
    # (first block, end block, context length L, visibility [b, 1, 1, g, 1, L + B] over [context 0..L-1 | own slots])
    groups: list[tuple[int, int, int, torch.Tensor]]


def blockwise_mask(blocks: Blocks, seq_len: int, group: int = 16) -> BlockwiseMask:
    b, n = blocks.anchors.shape
    B, dev = blocks.block_size, blocks.anchors.device
    groups = []
    for first in range(0, n, group):
        end = min(n, first + group)
        anchors, lo = blocks.anchors[:, first:end, None], blocks.ctx_lo[:, first:end, None]  # [b, g, 1]
        L = max(1, int(anchors.max()))  # no block sees a position at or past its anchor
        q_block = torch.arange(first, end, device=dev)[None, :, None]  # [1, g, 1]
        own_slots = seq_len + q_block * B + torch.arange(B, device=dev)  # [1, g, B]: the keys of its own block
        kv = torch.cat([torch.arange(L, device=dev).expand(1, end - first, L), own_slots], dim=2)  # [1, g, L + B]
        groups.append((first, end, L, visible(q_block, kv, lo, anchors, seq_len, B)[:, None, None, :, None, :]))
    return BlockwiseMask(blocks=blocks, seq_len=seq_len, groups=groups)


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockwiseMask,
                        scale: float | None = None) -> torch.Tensor:
    """Attention for all blocks without a dense [N*B, S+N*B] mask: a query of block j scores two key sets, the
    context its group can reach and its own block's B slots, in one softmax (which equals combining the two
    attentions by log-sum-exp). Plain matmuls, whose backward is cheaper on CPU than SDPA's; query heads are grouped
    by their key/value head (GQA) instead of repeating K and V. q [b, h, Q, d], k, v [b, kv_heads, S+Q, d]."""
    b, h, q_len, d = q.shape
    hkv = k.shape[1]
    rep = h // hkv  # query head i uses kv head i // rep
    n, B, S = mask.blocks.num_blocks, mask.blocks.block_size, mask.seq_len
    scale = d ** -0.5 if scale is None else scale
    score_dtype = torch.promote_types(q.dtype, torch.float32)
    q = q.reshape(b, hkv, rep, n, B, d)
    k_blk = k[:, :, S:].reshape(b, hkv, 1, n, B, d)
    v_blk = v[:, :, S:].reshape(b, hkv, 1, n, B, d)
    outs = []
    for first, end, L, seen in mask.groups:
        g = end - first
        qg = q[:, :, :, first:end]  # [b, hkv, rep, g, B, d]
        s_ctx = (qg.reshape(b, hkv, rep * g * B, d) @ k[:, :, :L].transpose(-1, -2)).view(b, hkv, rep, g, B, L)
        s_blk = qg @ k_blk[:, :, :, first:end].transpose(-1, -2)  # [b, hkv, rep, g, B, B]
        scores = torch.cat([s_ctx, s_blk], dim=-1).to(score_dtype) * scale
        seen = seen if seen.device == q.device else seen.to(q.device)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).to(q.dtype)
        out = (probs[..., :L].reshape(b, hkv, rep * g * B, L) @ v[:, :, :L]).view(b, hkv, rep, g, B, d)
        outs.append(out + probs[..., L:] @ v_blk[:, :, :, first:end])
    return torch.cat(outs, dim=3).reshape(b, h, q_len, d)


# --- picking a backend -------------------------------------------------------------------------------------------

ATTENTION_KINDS = ("sdpa", "flex", "blockwise")


def attention_for(blocks: Blocks, seq_len: int, kind: str):
    """(mask, attention function) of backend `kind` for these blocks, to pass to the model."""
    from dflash_train.model.modeling_dflash import sdpa_attention  # (the model module loads transformers)

    if kind == "sdpa":
        return dense_mask(blocks, seq_len), sdpa_attention
    if kind == "flex":
        return flex_block_mask(blocks, seq_len), flex_attention
    if kind == "blockwise":
        return blockwise_mask(blocks, seq_len), blockwise_attention
    raise ValueError(f"unknown attention kind {kind!r} (one of {', '.join(ATTENTION_KINDS)})")


def resolve_attention(kind: str, device: torch.device | str) -> str:
    """The recipe's objective.attention: auto = flex on CUDA (where torch has it), blockwise elsewhere."""
    if kind != "auto":
        return kind
    return "flex" if torch.device(device).type == "cuda" and create_block_mask is not None else "blockwise"
