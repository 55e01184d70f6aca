"""The blocks of a training row and THE visibility rule (dflash_train/model/masks.py): the dense mask by brute
force, and every backend (FlexAttention's mask_mod and BlockMask, the blockwise kernel) agreeing with it and with a
per-block loop, including the trainer's context warm-up and window."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train import objective as obj
from dflash_train.model import masks

B = 4


# --- the mask ---------------------------------------------------------------------------------------------


def _blocks_case():
    # two rows; row 1 is packed (samples start at 0 and 9) and has a padding block
    anchors = torch.tensor([[2, 5, 9], [3, 11, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    doc = torch.tensor([[0] * 14, [0] * 9 + [9] * 5])
    return masks.make_blocks(anchors, keep, B, doc), 14


def test_dense_mask_by_brute_force():
    blocks, S = _blocks_case()
    mask = masks.dense_mask(blocks, S)
    b, n = blocks.anchors.shape
    assert mask.shape == (b, 1, n * B, S + n * B)
    for r in range(b):
        for q in range(n * B):
            j = q // B
            a, lo = int(blocks.anchors[r, j]), int(blocks.ctx_start[r, j])
            for kv in range(S + n * B):
                expect = (lo <= kv < a) if kv < S else ((kv - S) // B == j)
                assert bool(mask[r, 0, q, kv]) == expect, (r, q, kv)
    # the anchor's own position is never visible as context ('<=' is the known leak)
    for r in range(b):
        for j in range(n):
            a = int(blocks.anchors[r, j])
            assert not mask[r, 0, j * B:(j + 1) * B, a].any()


def test_mask_mod_equals_dense_mask():
    blocks, S = _blocks_case()
    dense = masks.dense_mask(blocks, S)
    mod = masks.block_mask_mod(blocks, S)
    b, n = blocks.anchors.shape
    q = torch.arange(n * B)[:, None]
    kv = torch.arange(S + n * B)[None, :]
    for r in range(b):
        assert torch.equal(mod(torch.tensor(r), torch.tensor(0), q, kv), dense[r, 0])


def _attend_per_block(q, k, v, blocks, S):
    """Reference: every block separately over [its context window | its own slots]."""
    b, h, _, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.zeros_like(q)
    for r in range(b):
        for j in range(blocks.num_blocks):
            a, lo = int(blocks.anchors[r, j]), int(blocks.ctx_start[r, j])
            keys = torch.cat([k[r, :, lo:a], k[r, :, S + j * B:S + (j + 1) * B]], dim=1)
            vals = torch.cat([v[r, :, lo:a], v[r, :, S + j * B:S + (j + 1) * B]], dim=1)
            qj = q[r, :, j * B:(j + 1) * B]
            out[r, :, j * B:(j + 1) * B] = torch.softmax(qj @ keys.transpose(-1, -2) / math.sqrt(d), -1) @ vals
    return out


def _qkv(blocks, S, h=4, hkv=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    b, n = blocks.anchors.shape
    q = torch.randn(b, h, n * B, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, S + n * B, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, S + n * B, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("group", [1, 2, 16])
def test_dense_and_blockwise_attention_equal_a_per_block_loop(group):
    blocks, S = _blocks_case()
    q, k, v = _qkv(blocks, S)
    ref = _attend_per_block(q, k, v, blocks, S)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense_mask(blocks, S), enable_gqa=True)
    blockwise = masks.blockwise_attention(q, k, v, masks.blockwise_mask(blocks, S, group=group))
    assert torch.allclose(dense, ref, atol=1e-10)
    assert torch.allclose(blockwise, ref, atol=1e-10)
    # and the gradients agree
    for fn in (lambda q, k, v: masks.blockwise_attention(q, k, v, masks.blockwise_mask(blocks, S, group=group)),
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense_mask(blocks, S),
                                                              enable_gqa=True)):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        (fn(qs, ks, vs) * torch.linspace(-1, 1, q.numel(), dtype=q.dtype).view_as(q)).sum().backward()
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        (_attend_per_block(qr, kr, vr, blocks, S) * torch.linspace(-1, 1, q.numel(), dtype=q.dtype).view_as(q)
         ).sum().backward()
        for a_, b_ in ((qs, qr), (ks, kr), (vs, vr)):
            assert torch.allclose(a_.grad, b_.grad, atol=1e-10)


def test_context_warmup_blocks_see_only_their_own_slots():
    """context_window=0 (the trainer's context warm-up): every attention form hides the whole context, and the
    labels and weights stay those of the normal blocks."""
    import dataclasses

    blocks, S = _blocks_case()
    alone = dataclasses.replace(blocks, context_window=0)
    mask = masks.dense_mask(alone, S)
    assert not mask[..., :S].any()
    assert torch.equal(mask[..., S:], masks.dense_mask(blocks, S)[..., S:])
    mod = masks.block_mask_mod(alone, S)
    q_idx, kv_idx = torch.arange(blocks.num_blocks * B)[:, None], torch.arange(S + blocks.num_blocks * B)[None, :]
    assert torch.equal(mod(torch.tensor(1), torch.tensor(0), q_idx, kv_idx), mask[1, 0])
    q, k, v = _qkv(blocks, S)
    own_only = dataclasses.replace(blocks, anchors=blocks.ctx_start)  # the reference with an empty window
    ref = _attend_per_block(q, k, v, own_only, S)
    assert torch.allclose(masks.blockwise_attention(q, k, v, masks.blockwise_mask(alone, S)), ref, atol=1e-10)
    ids = torch.randint(0, 50, (2, S))
    lm = torch.ones(2, S, dtype=torch.bool)
    for x, y in zip(obj.block_labels(ids, lm, blocks, 7.0), obj.block_labels(ids, lm, alone, 7.0)):
        assert torch.equal(x, y)



def test_context_window_keeps_only_the_newest_positions_before_the_anchor():
    import dataclasses

    blocks, S = _blocks_case()
    narrow = dataclasses.replace(blocks, context_window=3)
    mask = masks.dense_mask(narrow, S)
    for r in range(blocks.anchors.shape[0]):
        for j in range(blocks.num_blocks):
            a, lo = int(blocks.anchors[r, j]), int(blocks.ctx_start[r, j])
            seen = mask[r, 0, j * B, :S].nonzero()[:, 0].tolist()
            assert seen == list(range(max(lo, a - 3), a)), (r, j)
    q, k, v = _qkv(blocks, S)
    ref = _attend_per_block(q, k, v, dataclasses.replace(blocks, ctx_start=narrow.ctx_lo), S)
    assert torch.allclose(masks.blockwise_attention(q, k, v, masks.blockwise_mask(narrow, S, group=2)), ref, atol=1e-10)
    mod = masks.block_mask_mod(narrow, S)
    q_idx, kv_idx = torch.arange(blocks.num_blocks * B)[:, None], torch.arange(S + blocks.num_blocks * B)[None, :]
    assert torch.equal(mod(torch.tensor(0), torch.tensor(0), q_idx, kv_idx), mask[0, 0])


def test_flex_attention_block_mask_agrees_with_the_dense_mask():
    """FlexAttention runs forward-only on CPU (torch 2.13): enough to prove that the BlockMask and the dense
    mask describe the same attention."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    blocks, S = _blocks_case()
    q, k, v = _qkv(blocks, S, dtype=torch.float32)
    block_mask = masks.flex_block_mask(blocks, S)
    try:
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    except (NotImplementedError, RuntimeError) as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex_attention does not run here: {err}")
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense_mask(blocks, S), enable_gqa=True)
    assert torch.allclose(flex, dense, atol=1e-5)
