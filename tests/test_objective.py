"""The DFlash objective: anchors, labels, weights, the chunked LM head + CE (against full-logits references kept
here), and (with the real drafter) the batched loss against a per-block loop. The block mask: test_masks.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train import objective as obj
from dflash_train.model import masks

B = 4


def chunked_head_ce(hidden, head, labels, weights, chunk=256):
    """(sum of weight x CE, greedy-correct) through the chunked head with hard labels only."""
    total, correct, _, _ = obj.chunked_head_loss(hidden, head, labels, weights, chunk)
    return total, correct


def chunked_head_soft_ce(hidden, head, labels, weights, topk_ids, topk_logprobs, soft_weight, chunk=256):
    return obj.chunked_head_loss(hidden, head, labels, weights, chunk, topk_ids, topk_logprobs, soft_weight)


def reference_head_ce(hidden, head, labels, weights):
    """The plain version (full logits, autograd through them)."""
    logits = (hidden @ head.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights.to(logits.dtype)).sum(), logits.argmax(dim=-1) == labels


def reference_head_soft_ce(hidden, head, labels, weights, topk_ids, topk_logprobs, soft_weight):
    """The plain soft-label loss (full logits, q_tail = 1 - sum q_K, autograd): (sum weight x ((1-a) CE + a KL),
    sum weight x KL)."""
    logits = (hidden @ head.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    ce = F.cross_entropy(logits, labels, reduction="none")
    log_q = torch.log_softmax(logits, dim=-1).gather(1, topk_ids)
    p, p_tail = obj.target_buckets(topk_logprobs, logits.dtype)
    kl = obj.bucket_kl(p, p_tail, log_q, 1.0 - log_q.exp().sum(dim=-1))
    w = weights.to(logits.dtype)
    return ((1.0 - soft_weight) * ce * w + soft_weight * kl * w).sum(), (kl * w).sum()


def _row(loss_mask: list[int]) -> torch.Tensor:
    return torch.tensor(loss_mask, dtype=torch.bool)[None]


# --- anchors ---------------------------------------------------------------------------------------------


def test_anchor_candidates_need_loss_mask_at_p_and_p_plus_1():
    lm = _row([0, 0, 1, 1, 1, 0, 1, 1, 0, 1])
    cand = obj.anchor_candidates(lm)[0].tolist()
    assert cand == [False, False, True, True, False, False, True, False, False, False]


def test_anchor_candidates_stay_inside_a_packed_sample():
    lm = _row([1, 1, 1, 1, 1, 1])
    doc = torch.tensor([[0, 0, 0, 3, 3, 3]])
    assert obj.anchor_candidates(lm, doc)[0].tolist() == [True, True, False, True, True, False]


def test_sampled_anchors_are_distinct_allowed_sorted_and_padded():
    torch.manual_seed(0)
    lm = torch.rand(3, 200) < 0.7
    lm[2] = False
    lm[2, 50:54] = True  # row 2 has exactly 3 candidates: 50, 51, 52
    cand = obj.anchor_candidates(lm)
    seen = set()
    for step in range(20):
        g = torch.Generator().manual_seed(step)
        blocks = obj.sample_anchors(lm, 16, B, generator=g)
        assert blocks.num_blocks == 16
        for r in range(3):
            kept = blocks.anchors[r][blocks.keep[r]]
            assert cand[r, kept].all()
            assert kept.unique().numel() == kept.numel()
            assert torch.equal(kept, kept.sort().values)
            assert blocks.keep[r].tolist() == sorted(blocks.keep[r].tolist(), reverse=True)  # padding last
        assert blocks.anchors[2][blocks.keep[2]].tolist() == [50, 51, 52]
        assert (blocks.anchors[~blocks.keep] == 0).all()
        seen.update(blocks.anchors[0][blocks.keep[0]].tolist())
    # resampled each step, uniformly: across 20 draws most candidates of row 0 show up
    assert len(seen) > 0.8 * int(cand[0].sum())


def test_number_of_blocks_is_capped_by_the_candidates():
    lm = _row([0, 1, 1, 1, 0])
    blocks = obj.sample_anchors(lm, 512, B)
    assert blocks.num_blocks == 2 and blocks.keep.all()
    empty = obj.sample_anchors(_row([0, 0, 1, 0]), 8, B)
    assert empty.num_blocks == 1 and not empty.keep.any()


def test_anchor_sampling_is_uniform():
    lm = _row([1] * 11)  # candidates 0..9
    counts = torch.zeros(11)
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        blocks = obj.sample_anchors(lm, 3, B, generator=g)
        counts[blocks.anchors[0]] += 1
    assert counts[10] == 0
    freq = counts[:10] / 2000
    assert torch.allclose(freq, torch.full((10,), 0.3), atol=0.04)


def test_weighted_anchor_sampling_draws_in_proportion_to_the_weights():
    lm = _row([1] * 11)  # candidates 0..9
    weights = torch.ones(1, 11)
    weights[0, :2] = 4.0  # anchors 0 and 1 four times as likely on every draw
    counts = torch.zeros(11)
    g = torch.Generator().manual_seed(0)
    for _ in range(4000):
        counts[obj.sample_anchors(lm, 1, B, generator=g, weights=weights).anchors[0]] += 1
    assert counts[10] == 0
    freq = counts[:10] / 4000
    expected = torch.tensor([4.0, 4.0] + [1.0] * 8) / 16
    assert torch.allclose(freq, expected, atol=0.025)


def test_repeats_context_marks_a_bigram_seen_before_in_the_same_sample():
    ids = torch.tensor([[5, 6, 7, 5, 6, 9, 6, 9, 5, 6]])
    assert obj.repeats_context(ids)[0].tolist() == [False, False, False, False, True, False, False, True, False, True]
    # packed: the second sample [5, 6, 7, 5, 6] starts at 5; its first "5 6" is new there, the second repeats it
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 5, 6]])
    doc = torch.tensor([[0] * 5 + [5] * 5])
    assert obj.repeats_context(ids, doc)[0].tolist() == [False] * 5 + [False, False, False, False, True]


# --- blocks, labels, weights --------------------------------------------------------------------------------


def test_block_construction_and_same_position_labels():
    ids = torch.arange(100, 112)[None]  # token at position p is 100 + p
    lm = _row([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0])
    blocks = masks.make_blocks(torch.tensor([[2, 8]]), torch.tensor([[True, True]]), B)
    MASK = 7
    assert obj.block_input_ids(ids, blocks, MASK).tolist() == [[102, 7, 7, 7, 108, 7, 7, 7]]
    pos = torch.arange(12)[None]
    assert obj.block_position_ids(pos, blocks).tolist() == [[2, 3, 4, 5, 8, 9, 10, 11]]
    labels, weights = obj.block_labels(ids, lm, blocks, gamma=7.0)
    # slot k predicts the token AT anchor + k (not anchor + k + 1)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]
    decay = [0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)]
    assert torch.allclose(weights[0, 0], torch.tensor(decay))
    # block 1: slot 3 is position 11, outside the loss mask -> no weight
    assert labels[0, 1].tolist() == [108, 109, 110, 111]
    assert torch.allclose(weights[0, 1], torch.tensor(decay[:3] + [0.0]))


def test_labels_past_the_row_end_or_in_another_sample_get_no_weight():
    ids = torch.arange(10)[None]
    lm = _row([1] * 10)
    doc = torch.tensor([[0] * 6 + [6] * 4])
    blocks = masks.make_blocks(torch.tensor([[4, 8]]), torch.tensor([[True, True]]), B, doc)
    assert blocks.ctx_start.tolist() == [[0, 6]]
    _, w = obj.block_labels(ids, lm, blocks, gamma=7.0, doc_start=doc)
    assert (w[0, 0] > 0).tolist() == [False, True, False, False]  # 6 and 7 belong to the next sample
    assert (w[0, 1] > 0).tolist() == [False, True, False, False]  # 10, 11 are past the end
    pad = masks.make_blocks(torch.tensor([[4]]), torch.tensor([[False]]), B)
    assert obj.block_labels(ids, lm, pad, gamma=7.0)[1].sum() == 0


def test_slot_decay():
    d = obj.slot_decay(16, 7.0)
    assert d[0] == 0 and d[1] == 1
    assert torch.allclose(d[1:], torch.exp(-torch.arange(15.0) / 7))


# --- chunked LM head + CE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunked_head_ce_equals_full_logits(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, V = 37, 16, 101
    hidden = torch.randn(T, H, generator=g).to(dtype)
    head = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[:10] = (hidden[:10].double() @ head.double().t()).argmax(-1)  # some rows are predicted right
    weights = torch.rand(T, generator=g)
    weights[::5] = 0
    h1 = hidden.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()
    loss1, pred1 = chunked_head_ce(h1, head, labels, weights, chunk=8)
    loss2, pred2 = reference_head_ce(h2, head, labels, weights)
    (loss1 * 0.5).backward()
    (loss2 * 0.5).backward()
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(loss1, loss2, **tol)
    assert torch.equal(pred1, pred2)  # greedy prediction == label, per row
    assert pred1.dtype == torch.bool
    assert torch.allclose(h1.grad.double(), h2.grad.double(), **tol)
    assert not head.requires_grad


def test_chunked_head_ce_without_grad_and_empty():
    head = torch.randn(11, 4)
    loss, preds = chunked_head_ce(torch.randn(5, 4), head, torch.zeros(5, dtype=torch.long), torch.ones(5))
    assert loss.ndim == 0 and preds.shape == (5,)
    loss, preds = chunked_head_ce(torch.zeros(0, 4, requires_grad=True), head,
                                      torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert float(loss.detach()) == 0.0 and preds.numel() == 0


# --- with the real drafter -------------------------------------------------------------------------------------


def _tiny_drafter(tiny_target, num_layers=2, block_size=B, seed=0):
    from tiny import make_tiny_drafter

    drafter, _ = make_tiny_drafter(tiny_target.config, tiny_target.tokenizer, num_layers=num_layers,
                                   block_size=block_size, seed=seed, target_layer_ids=[1, 3, 5])
    embed = tiny_target.model.get_input_embeddings().weight.detach().float()
    head = tiny_target.model.get_output_embeddings().weight.detach().float()
    return drafter.float(), embed, head


def _synthetic_batch(S=24, V=1024, width=3 * 64, seed=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, V, (2, S), generator=g)
    loss_mask = torch.ones(2, S, dtype=torch.bool)
    loss_mask[:, :5] = False
    loss_mask[1, 9:] = False  # row 1 is a short sample, padded: 3 anchor candidates
    batch = {"input_ids": ids, "loss_mask": loss_mask, "hidden_states": torch.randn(2, S, width, generator=g),
             "position_ids": torch.arange(S).expand(2, -1).clone()}
    if packed:  # row 0 holds two samples: 0..13 and 14..S-1
        batch["doc_start"] = torch.zeros(2, S, dtype=torch.long)
        batch["doc_start"][0, 14:] = 14
        batch["position_ids"][0, 14:] = torch.arange(S - 14)
        batch["loss_mask"][0, 14:17] = False
    return batch


def _per_block_loss(drafter, embed, head, batch, blocks, gamma, mask_id, ids=None):
    """Reference: run every block on its own through the drafter, with only the context it may see and no mask.
    `ids`: a draft vocabulary, scored as the whole head's logits at those ids; a label outside it has no weight."""
    labels, weights = obj.block_labels(batch["input_ids"], batch["loss_mask"], blocks, gamma, batch.get("doc_start"))
    if ids is not None:
        weights = weights * torch.isin(labels, torch.tensor(ids))
        labels = torch.tensor([ids.index(t) if t in ids else 0 for t in labels.flatten().tolist()]).view_as(labels)
    total = torch.zeros(())
    for r in range(blocks.anchors.shape[0]):
        for j in range(blocks.num_blocks):
            if not blocks.keep[r, j]:
                continue
            a, lo = int(blocks.anchors[r, j]), int(blocks.ctx_start[r, j])
            pos = batch["position_ids"][r]
            block = torch.full((1, B), mask_id)
            block[0, 0] = batch["input_ids"][r, a]
            out = drafter(position_ids=torch.cat([pos[lo:a], pos[a] + torch.arange(B)])[None],
                          noise_embedding=F.embedding(block, embed),
                          target_hidden=batch["hidden_states"][r:r + 1, lo:a])
            logits = out[0] @ head.t()
            ce = F.cross_entropy(logits if ids is None else logits[:, ids], labels[r, j], reduction="none")
            total = total + (ce * weights[r, j]).sum()
    return total / weights.sum()


@pytest.mark.parametrize("packed", [False, True])
def test_batched_loss_equals_a_per_block_loop(tiny_target, packed):
    drafter, embed, head = _tiny_drafter(tiny_target)
    mask_id = drafter.mask_token_id
    batch = _synthetic_batch(packed=packed)
    blocks = obj.sample_anchors(batch["loss_mask"], 6, B, torch.Generator().manual_seed(3), batch.get("doc_start"))
    assert not blocks.keep.all()  # the case includes padding blocks
    ref = _per_block_loss(drafter, embed, head, batch, blocks, 7.0, mask_id)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    for attention in ("sdpa", "blockwise"):
        drafter.zero_grad()
        out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=mask_id, gamma=7.0,
                              attention=attention, head_chunk_tokens=7)
        out.loss.backward()
        assert torch.allclose(out.loss, ref, rtol=1e-5, atol=1e-6), (attention, out.loss, ref)
        for n, p in drafter.named_parameters():
            assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), (attention, n)
    assert out.counted[0] == 0 and out.counted[1:].sum() == (obj.block_labels(
        batch["input_ids"], batch["loss_mask"], blocks, 7.0, batch.get("doc_start"))[1] > 0).sum()


def test_a_draft_vocabulary_scores_only_its_rows_and_drops_the_labels_outside_it(tiny_target):
    """Training with a draft vocabulary's rows of the head (labels as rows, `draft_rows`) is the whole head's loss
    at those ids, the labels outside them without weight; its simulated acceptance drafts what the exported
    drafter (its rows and d2t, `DFlashDraftModel.logits`) drafts, at every anchor."""
    from tiny import make_tiny_drafter

    from dflash_train.model.checkpoint import create_drafter, draft_vocabulary

    drafter, config = make_tiny_drafter(tiny_target.config, tiny_target.tokenizer, num_layers=2, block_size=B,
                                        target_layer_ids=[1, 3, 5])
    drafter = drafter.float()
    embed = tiny_target.model.get_input_embeddings().weight.detach().float()
    head = tiny_target.model.get_output_embeddings().weight.detach().float()
    batch = _synthetic_batch(packed=True)
    blocks = obj.sample_anchors(batch["loss_mask"], 6, B, torch.Generator().manual_seed(3), batch["doc_start"])
    labels, weights = obj.block_labels(batch["input_ids"], batch["loss_mask"], blocks, 7.0, batch["doc_start"])
    supervised = sorted(set(labels[weights > 0].tolist()))
    ids = sorted({*supervised[::2], 3, 7})  # half the labels in, and ids no label uses
    ref = _per_block_loss(drafter, embed, head, batch, blocks, 7.0, drafter.mask_token_id, ids)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    rows = obj.draft_rows(torch.tensor(ids), head.shape[0])
    assert rows[torch.tensor(ids)].tolist() == list(range(len(ids))) and int((rows >= 0).sum()) == len(ids)
    out = obj.dflash_loss(drafter, embed, head[ids], batch, blocks, mask_token_id=drafter.mask_token_id, gamma=7.0,
                          head_chunk_tokens=7, label_rows=rows)
    out.loss.backward()
    assert torch.allclose(out.loss, ref, rtol=1e-5, atol=1e-6), (out.loss, ref)
    for n, p in drafter.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), n
    assert out.counted.sum() == int(((weights > 0) & torch.isin(labels, torch.tensor(ids))).sum())
    cut_config, cut_rows = draft_vocabulary(config, head, ids)
    cut = create_drafter(cut_config).float()
    cut.load_state_dict({**drafter.state_dict(), **cut_rows})
    # a sample whose answer, after its first anchor (position 5), is what the exported drafter drafts there: every
    # draft of that block is right, and wrong wherever a row is mapped to another id
    sample = {"input_ids": batch["input_ids"][0].clone(), "loss_mask": torch.arange(24) >= 5,
              "hidden_states": batch["hidden_states"][0]}
    block = torch.tensor([int(sample["input_ids"][5])] + [drafter.mask_token_id] * (B - 1))
    with torch.no_grad():
        hidden = cut(position_ids=torch.arange(5 + B)[None], noise_embedding=embed[block][None],
                     target_hidden=sample["hidden_states"][None, :5])
        sample["input_ids"][6:5 + B] = cut.logits(hidden[0, 1:], head).argmax(-1)
    trained = obj.simulated_acceptance(drafter, embed, head[ids], sample, B, draft_ids=torch.tensor(ids))
    exported = obj.simulated_acceptance(cut, embed, head, sample, B)
    assert exported[0] == B and torch.equal(trained, exported)


def test_the_per_block_reference_catches_a_leaky_mask(tiny_target):
    """Letting blocks see the context state at their own anchor ('<=' instead of '<', the known leak) changes
    the loss, so the equality above is a real check."""
    drafter, embed, head = _tiny_drafter(tiny_target)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.mul_(20)  # a random drafter at init attends almost uniformly; make attention matter
    mask_id = drafter.mask_token_id
    batch = _synthetic_batch()
    blocks = obj.sample_anchors(batch["loss_mask"], 6, B, torch.Generator().manual_seed(3))
    leaky = masks.make_blocks(blocks.anchors + 1, blocks.keep, B)
    with torch.no_grad():
        ref = _per_block_loss(drafter, embed, head, batch, blocks, 7.0, mask_id)
        good = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=mask_id, gamma=7.0).loss
        positions = torch.cat([batch["position_ids"], obj.block_position_ids(batch["position_ids"], blocks)], 1)
        hidden = drafter(position_ids=positions, target_hidden=batch["hidden_states"],
                         noise_embedding=F.embedding(obj.block_input_ids(batch["input_ids"], blocks, mask_id), embed),
                         attention_mask=masks.dense_mask(leaky, batch["input_ids"].shape[1]))
        labels, weights = obj.block_labels(batch["input_ids"], batch["loss_mask"], blocks, 7.0)
        leak = (F.cross_entropy((hidden @ head.t()).flatten(0, 1), labels.flatten(), reduction="none")
                * weights.flatten()).sum() / weights.sum()
    assert torch.allclose(good, ref, rtol=1e-5)
    assert abs(float(leak - ref)) > 100 * abs(float(good - ref)) + 1e-4, (leak, ref, good)


# --- soft labels: the K+1-bucket KL against the target's top-k -----------------------------------------------------


def _soft_case(dtype, T=37, H=16, V=101, K=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    head = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    target = torch.log_softmax(torch.randn(T, V, generator=g).double() * 2, dim=-1)
    logp, ids = target.topk(K, dim=-1)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[:20] = ids[:20, 0]  # most labels are the target's argmax, some are outside its top-k
    weights = torch.rand(T, generator=g)
    weights[::6] = 0
    return hidden, head, labels, weights, ids, logp.half()  # float16, as stored


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("a", [0.0, 0.5, 1.0])
def test_chunked_soft_loss_and_gradient_equal_a_full_logits_reference(dtype, a):
    hidden, head, labels, weights, ids, logp = _soft_case(dtype)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss1, hit, ce, kl = chunked_head_soft_ce(h1, head, labels, weights, ids, logp, a, chunk=8)
    loss2, kl2 = reference_head_soft_ce(h2, head, labels, weights, ids, logp, a)
    (loss1 * 0.7).backward()
    (loss2 * 0.7).backward()
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(loss1.detach().double(), loss2.detach().double(), **tol)
    assert torch.allclose(h1.grad.double(), h2.grad.double(), **tol)
    assert torch.equal(hit, reference_head_ce(hidden, head, labels, weights)[1])
    assert torch.allclose(ce.double(), reference_head_ce(hidden, head, labels, weights)[0].double(), **tol)
    if a > 0:
        assert torch.allclose(kl.double(), kl2.detach().double(), **tol) and float(kl) > 0
    else:
        assert kl is None


def test_soft_weight_0_is_the_plain_path_bit_for_bit():
    hidden, head, labels, weights, ids, logp = _soft_case(torch.bfloat16)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss1, hit1, _, _ = chunked_head_soft_ce(h1, head, labels, weights, ids, logp, 0.0, chunk=8)
    loss2, hit2 = chunked_head_ce(h2, head, labels, weights, chunk=8)
    loss1.backward()
    loss2.backward()
    assert torch.equal(loss1, loss2) and torch.equal(hit1, hit2) and torch.equal(h1.grad, h2.grad)


@pytest.mark.parametrize("stored", [torch.float64, torch.float16])
def test_kl_is_zero_when_the_drafter_equals_the_target_and_positive_otherwise(stored):
    g = torch.Generator().manual_seed(1)
    T, V, K = 12, 64, 6
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 3  # the target's, and the drafter's
    logp, ids = torch.log_softmax(logits, dim=-1).topk(K, dim=-1)  # the "stored" soft labels
    logp = logp.to(stored)
    head = torch.eye(V, dtype=torch.float64)  # hidden @ head.T = the logits themselves
    weights = torch.ones(T, dtype=torch.float64)
    same = logits.clone().requires_grad_()
    total, _, _, kl = chunked_head_soft_ce(same, head, ids[:, 0], weights, ids, logp, 1.0, chunk=5)
    total.backward()  # the gradient vanishes too: the target's distribution is the minimum
    tol = 1e-12 if stored == torch.float64 else 1e-5  # float16 storage rounds p a little
    assert abs(float(kl)) < tol * T and same.grad.abs().max() < (1e-12 if stored == torch.float64 else 1e-3)
    for scale in (1.1, 0.5):  # sharper or flatter than the target: KL > 0
        _, _, _, kl = chunked_head_soft_ce(logits * scale, head, ids[:, 0], weights, ids, logp, 1.0)
        assert float(kl) > 1e-3 * T
    for seed in range(10, 15):  # random drafters (not seed 1, the target itself): KL > 0 row by row
        other = torch.randn(T, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
        for t in range(T):
            _, _, _, kl = chunked_head_soft_ce(other[t:t + 1], head, ids[t:t + 1, 0], weights[:1],
                                                   ids[t:t + 1], logp[t:t + 1], 1.0)
            assert float(kl) > 0


def test_soft_loss_survives_a_drafter_that_puts_everything_on_the_top_k():
    V, K = 40, 3
    logits = torch.full((2, V), -1e4, dtype=torch.float32)
    logits[:, :K] = torch.tensor([3.0, 2.0, 1.0])  # q_tail underflows to 0
    ids = torch.arange(K).expand(2, -1).clone()
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.5, 0.3, 0.2]]))  # p_tail 0.2 and 0 (sum rounds to 1)
    h = logits.clone().requires_grad_()
    total, _, _, kl = chunked_head_soft_ce(h, torch.eye(V), ids[:, 0], torch.ones(2), ids, logp, 0.5)
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(kl) and torch.isfinite(h.grad).all()
    assert float(kl) > 0.2 * 60  # p_tail 0.2 against q_tail at the 1e-30 floor


def test_block_topk_gathers_like_block_labels():
    S, K = 12, 3
    ids = torch.arange(100, 100 + S)[None]
    lm = _row([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0])
    topk_ids = ids[:, :, None] * 10 + torch.arange(K)  # position p holds 10 * (100 + p) + j
    topk_logp = -torch.arange(S, dtype=torch.float32)[None, :, None].expand(-1, -1, K)
    blocks = masks.make_blocks(torch.tensor([[2, 8]]), torch.tensor([[True, True]]), B)
    labels, weights = obj.block_labels(ids, lm, blocks, gamma=7.0)
    got_ids, got_logp = obj.block_topk(topk_ids, topk_logp, blocks)
    assert got_ids.shape == (1, 2, B, K) and torch.equal(got_ids // 10, labels[..., None].expand(-1, -1, -1, K))
    assert got_logp[0, 0, :, 0].tolist() == [-2, -3, -4, -5]
    assert got_logp[0, 1, :, 0].tolist() == [-8, -9, -10, -11]


def _with_topk(batch, V=1024, K=4, seed=5):
    g = torch.Generator().manual_seed(seed)
    b, S = batch["input_ids"].shape
    logp, ids = torch.log_softmax(torch.randn(b, S, V, generator=g) * 3, dim=-1).topk(K, dim=-1)
    return {**batch, "topk_ids": ids, "topk_logprobs": logp.half().float()}


def test_dflash_loss_with_soft_labels_equals_the_full_logits_reference(tiny_target):
    drafter, embed, head = _tiny_drafter(tiny_target)
    mask_id = drafter.mask_token_id
    batch = _with_topk(_synthetic_batch(packed=True))
    blocks = obj.sample_anchors(batch["loss_mask"], 6, B, torch.Generator().manual_seed(3), batch["doc_start"])
    labels, weights = obj.block_labels(batch["input_ids"], batch["loss_mask"], blocks, 7.0, batch["doc_start"])
    top_ids, top_logp = obj.block_topk(batch["topk_ids"], batch["topk_logprobs"], blocks)
    hidden = obj.draft_hidden(drafter, embed, batch, blocks, mask_id, "sdpa").flatten(0, 1)
    w = weights.flatten() / weights.sum()
    ref, ref_kl = reference_head_soft_ce(hidden, head, labels.flatten(), w, top_ids.flatten(0, 2),
                                             top_logp.flatten(0, 2), 0.5)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    out = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=mask_id, gamma=7.0,
                          head_chunk_tokens=7, soft_label_weight=0.5)
    out.loss.backward()
    assert torch.allclose(out.loss, ref, rtol=1e-5) and torch.allclose(out.kl, ref_kl.detach(), rtol=1e-5)
    assert torch.allclose(0.5 * out.ce + 0.5 * out.kl, out.loss.detach(), rtol=1e-6)
    for n, p in drafter.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), n
    with torch.no_grad():  # a = 0 ignores the top-k and is the plain CE exactly
        plain = obj.dflash_loss(drafter, embed, head, _synthetic_batch(packed=True), blocks, mask_token_id=mask_id,
                                gamma=7.0)
        zero = obj.dflash_loss(drafter, embed, head, batch, blocks, mask_token_id=mask_id, gamma=7.0)
    assert torch.equal(plain.loss, zero.loss) and zero.kl is None and torch.equal(plain.loss, zero.ce)
    with pytest.raises(ValueError, match="topk"):
        obj.dflash_loss(drafter, embed, head, _synthetic_batch(), blocks, mask_token_id=mask_id, gamma=7.0,
                        soft_label_weight=0.5)


def test_decoded_steps_walk_the_anchors_as_greedy_decoding_does():
    """From the acceptance length at every anchor, decoding's steps: the first at the first response token, the
    next at the anchor after what the last committed, each cut at K + 1; a second response starts its own walk."""
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)  # two responses
    sample = {"loss_mask": loss_mask}
    # anchors: positions 2..7 (response one, 7 tokens) and 11, 12 (response two, 3 tokens)
    lengths = [3, 1, 1, 4, 2, 1, 2, 1]
    assert obj.decoded_steps(sample, lengths, block_size=4) == [3, 4, 2]  # 2 -> 5 -> 9 (ends) | 11 -> 13 (ends)
    assert obj.decoded_steps(sample, lengths, block_size=4, k=1) == [2, 1, 2, 1, 2]  # 2, 4, 5, 7 | 11
    easy_then_hard = [4, 4, 4, 1, 1, 1, 2, 1]
    walked = obj.decoded_steps(sample, easy_then_hard, block_size=4)
    assert walked == [4, 1, 1, 2]  # tau 2.0, where the mean over every anchor says 2.25
    assert sum(walked) / len(walked) < sum(easy_then_hard) / len(easy_then_hard)
    with pytest.raises(AssertionError):
        obj.decoded_steps(sample, lengths[:-1], block_size=4)
