"""The DFlash training objective: anchors, blocks, the block attention mask and the decay-weighted loss.

One training row holds S context tokens (one or several packed samples) and their tapped target states. We
pick N anchor positions a_j and build N blocks; block j is `[ids[a_j], MASK x (B-1)]` at positions
a_j .. a_j+B-1, and slot k >= 1 predicts ids[a_j + k] (same-position labels: the drafter's output at the
position of token t predicts t itself). All blocks of a row go through the drafter in one forward; which keys
each block sees (the context strictly before its anchor, its own slots, no other block) is the one rule of
dflash_train/model/masks.py.

The loss is cross-entropy through the target's frozen LM head with weight exp(-(k-1)/gamma) on slot k times
the loss mask at the label position, normalised by the sum of the weights. The LM head and CE run in chunks
of slots and produce the gradient for the drafter's hidden states in the same pass, so neither the full
[N*B, vocab] logits nor a recompute of them in backward ever happens.

Soft labels (objective.soft_label_weight = a > 0, a store captured with --store-topk K): each slot's loss
becomes (1 - a) CE(hard label) + a KL, where KL compares the target's distribution predicting the label
position with the drafter's over K+1 buckets: the target's top-K tokens and one "everything else" bucket,
KL = sum_K p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail), p_tail = 1 - sum_K p_i, q_tail = 1 - sum_K q_i.
It is 0 iff the drafter puts the target's probability on each top-K token and the rest on the others, and its
gradient w.r.t. the logits z is q_j - p_j (j in K) and q_j (1 - p_tail / q_tail) (j not in K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash_train.model.masks import Blocks, attention_for, make_blocks

if TYPE_CHECKING:
    from dflash_train.store.format import SampleTensors


# --- anchors and blocks ------------------------------------------------------------------------------------


def anchor_candidates(loss_mask: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """[b, S] bool: p may be an anchor iff loss_mask[p] and loss_mask[p+1] (and both in the same sample).

    The anchor is a token the target produced and the block must predict at least one more response token,
    so a block never starts in the prompt and never has only unsupervised slots."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    cand[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    if doc_start is not None:
        cand[:, :-1] &= doc_start[:, :-1] == doc_start[:, 1:]
    return cand


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None, doc_start: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None) -> Blocks:
    """Up to `num_anchors` anchors per row, without replacement among the candidates: uniformly, or with
    probability proportional to `weights` [b, S] (> 0) as successive draws (an exponential race: each candidate
    gets E / w with E ~ Exp(1), the smallest win).

    N = min(num_anchors, the most candidates any row has) (at least 1); rows with fewer candidates get
    padding blocks."""
    cand = anchor_candidates(loss_mask, doc_start)
    b, S = cand.shape
    counts = cand.sum(dim=1)
    n = max(1, min(num_anchors, int(counts.max())))
    scores = torch.rand(b, S, generator=generator, device="cpu").to(cand.device)
    if weights is not None:
        scores = -torch.log1p(-scores) / weights
    scores = torch.where(cand, scores, torch.full_like(scores, float("inf")))  # non-candidates sort last
    picked = scores.argsort(dim=1)[:, :n]
    keep = cand.gather(1, picked)
    # sort kept anchors ascending and padding blocks last
    order = torch.where(keep, picked, picked + S).argsort(dim=1)
    picked, keep = picked.gather(1, order), keep.gather(1, order)
    return make_blocks(picked, keep, block_size, doc_start)


def repeats_context(input_ids: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """[b, S] bool: the two tokens ending at p, ids[p-1] ids[p], already occur earlier in p's sample (p's own
    prompt or response). There prompt lookup drafts what followed them, and a drafter can copy it from the
    context: loops, lists, quoted input."""
    b, S = input_ids.shape
    vocab = int(input_ids.max()) + 1
    doc = doc_start if doc_start is not None else torch.zeros_like(input_ids)
    key = (doc * vocab + input_ids.roll(1, dims=1)) * vocab + input_ids  # one int64 per (sample, bigram)
    pos = torch.arange(S, device=input_ids.device).expand(b, S)
    out = torch.zeros(b, S, dtype=torch.bool, device=input_ids.device)
    for r in range(b):
        _, group = torch.unique(key[r], return_inverse=True)
        first = torch.full((S,), S, dtype=torch.long, device=input_ids.device)
        first = first.scatter_reduce(0, group, pos[r], reduce="amin")
        out[r] = first[group] < pos[r]
    out[:, 0] = False  # position 0 has no preceding token in its row
    if doc_start is not None:
        out &= doc_start < pos  # nor a sample's first position in its sample
    return out


def all_anchors(loss_mask: torch.Tensor, block_size: int, doc_start: torch.Tensor | None = None) -> Blocks:
    """Every candidate position of a single row [1, S] as an anchor (for simulated acceptance)."""
    assert loss_mask.shape[0] == 1
    anchors = anchor_candidates(loss_mask, doc_start)[0].nonzero()[:, 0][None]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    return make_blocks(anchors, keep, block_size, doc_start)


def block_input_ids(input_ids: torch.Tensor, blocks: Blocks, mask_token_id: int) -> torch.Tensor:
    """[b, N*B]: block j is [ids[a_j], MASK x (B-1)]."""
    b, n = blocks.anchors.shape
    ids = torch.full((b, n, blocks.block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, blocks.anchors)
    return ids.view(b, n * blocks.block_size)


def block_position_ids(position_ids: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """[b, N*B]: slot k of block j sits at position(a_j) + k."""
    b, n = blocks.anchors.shape
    offsets = torch.arange(blocks.block_size, device=position_ids.device)
    return (position_ids.gather(1, blocks.anchors)[:, :, None] + offsets).view(b, n * blocks.block_size)


def slot_decay(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B]: 0 for slot 0 (the anchor itself, no loss), exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    decay = torch.exp(-(k - 1) / gamma)
    decay[0] = 0.0
    return decay


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, blocks: Blocks, gamma: float,
                 doc_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels and loss weights, both [b, N, B].

    labels[j, k] = ids[a_j + k]; weight = decay(k) x loss_mask[a_j + k] x (a_j + k inside the row and inside
    the anchor's sample) x keep[j]. Slot 0 has weight 0."""
    S = input_ids.shape[1]
    B = blocks.block_size
    idx = blocks.anchors[:, :, None] + torch.arange(B, device=input_ids.device)  # [b, N, B]
    inside = idx < S
    idx_c = idx.clamp(max=S - 1)
    flat = idx_c.flatten(1)
    labels = input_ids.gather(1, flat).view_as(idx)
    ok = loss_mask.gather(1, flat).view_as(idx) & inside & blocks.keep[:, :, None]
    if doc_start is not None:
        ok &= doc_start.gather(1, flat).view_as(idx) == blocks.ctx_start[:, :, None]
    weights = ok.float() * slot_decay(B, gamma, input_ids.device)
    return labels, weights


def block_topk(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, blocks: Blocks
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored top-k ids and log-probs [b, S, K] at each block's label positions a_j + k: [b, N, B, K] each,
    gathered exactly like `block_labels` (positions past the row end repeat the last one; they have weight 0)."""
    b, S, K = topk_ids.shape
    B = blocks.block_size
    idx = (blocks.anchors[:, :, None] + torch.arange(B, device=topk_ids.device)).clamp(max=S - 1)  # [b, N, B]
    flat = idx.flatten(1)[:, :, None].expand(-1, -1, K)
    shape = (*idx.shape, K)
    return topk_ids.gather(1, flat).view(shape), topk_logprobs.gather(1, flat).view(shape)


# --- LM head + cross-entropy, chunked and fused ---------------------------------------------------------------


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_t weight_t * CE(hidden_t @ head^T, label_t), processed `chunk` rows at a time.

    The gradient w.r.t. hidden is computed in the same chunk loop as the loss (softmax - onehot, times the
    weight, times the head), so backward just scales a stored tensor: no logits are ever recomputed and at
    most [chunk, vocab] of them exist at once. The head is frozen: it gets no gradient.

    The logits stay in the head's dtype (bf16 in training): log_softmax computes in fp32 internally and its
    output is what the gradient matmul consumes anyway, which saves several full passes over [chunk, vocab] in
    fp32. The label's entry, softmax - 1, comes from expm1(log p) in fp32 so that it stays exact as p -> 1;
    the reported CE carries bf16's relative rounding (2^-9) per token.

    With soft labels (topk_ids, topk_logprobs [T, K] and a = soft_weight > 0) the per-row loss is
    weight * ((1 - a) CE + a KL) (the K+1-bucket KL of the module docstring), its gradient is built in the same
    loop, and the outputs also carry the weighted sums of CE and KL. q_tail is summed over the non-top-k
    probabilities themselves (no 1 - sum cancellation) and both tails are clamped away from 0 in the logs."""

    @staticmethod
    def forward(ctx, hidden, head, labels, weights, chunk, topk_ids=None, topk_logprobs=None, soft_weight=0.0):
        if topk_ids is not None and soft_weight > 0:
            return _soft_forward(ctx, hidden, head, labels, weights, chunk, topk_ids, topk_logprobs, soft_weight)
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        correct = torch.empty_like(labels, dtype=torch.bool)
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            rows = torch.arange(e - s, device=hidden.device)
            lab, w = labels[s:e], weights[s:e].to(acc_dtype)
            logits = hidden[s:e] @ head.t()  # [c, V]
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            # greedy prediction is right iff the label's logit is the largest (amax is vectorised, argmax is not)
            correct[s:e] = logp[rows, lab] >= logp.amax(dim=-1)
            logp_label = logp[rows, lab].to(acc_dtype)
            total += (-logp_label * w).sum()
            if need_grad:
                probs = logp.exp_()  # in place: softmax
                probs.mul_(w[:, None].to(probs.dtype))
                probs[rows, lab] = (w * torch.expm1(logp_label)).to(probs.dtype)
                grad_hidden[s:e] = probs @ head
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        ce_total = total.detach().clone()
        ctx.mark_non_differentiable(correct, ce_total)
        return total, correct, ce_total, None

    @staticmethod
    def backward(ctx, grad_total, grad_correct, grad_ce, grad_kl):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None, None


TAIL_FLOOR = 1e-30  # smallest tail probability taken into a log (fp32 keeps it; its log is -69)


def target_buckets(topk_logprobs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_K [c, K], p_tail [c]) in `dtype` (fp32 or wider) from stored log-probs; -inf entries are probability 0.
    Rounding in storage can make sum p_K exceed 1 slightly: then p_K is scaled back to sum 1 and p_tail is 0."""
    p = topk_logprobs.to(dtype).exp()
    p = p / p.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return p, (1.0 - p.sum(dim=-1)).clamp(min=0.0)


def bucket_kl(p: torch.Tensor, p_tail: torch.Tensor, log_q: torch.Tensor, q_tail: torch.Tensor) -> torch.Tensor:
    """[c]: sum_K p (log p - log q) + p_tail (log p_tail - log q_tail), with 0 log 0 = 0."""
    log_q_tail = q_tail.clamp(min=TAIL_FLOOR).log()
    head_part = torch.xlogy(p, p) - torch.where(p > 0, p * log_q, torch.zeros_like(p))
    return head_part.sum(dim=-1) + torch.xlogy(p_tail, p_tail) - p_tail * log_q_tail


def _soft_forward(ctx, hidden, head, labels, weights, chunk, topk_ids, topk_logprobs, a):
    """The soft-label branch of _ChunkedHeadCE.forward (see its docstring)."""
    need_grad = ctx.needs_input_grad[0]
    grad_hidden = torch.empty_like(hidden) if need_grad else None
    correct = torch.empty_like(labels, dtype=torch.bool)
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    ce_total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    kl_total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        e = min(s + chunk, hidden.shape[0])
        rows = torch.arange(e - s, device=hidden.device)
        lab, w, ids = labels[s:e], weights[s:e].to(acc_dtype), topk_ids[s:e].long()
        logp = torch.log_softmax(hidden[s:e] @ head.t(), dim=-1)  # [c, V]
        correct[s:e] = logp[rows, lab] >= logp.amax(dim=-1)
        logp_label = logp[rows, lab].to(acc_dtype)
        log_q = logp.gather(1, ids).to(acc_dtype)  # [c, K]
        probs = logp.exp_()  # in place: softmax
        del logp
        probs.scatter_(1, ids, 0.0)  # the non-top-k entries only
        q_tail = probs.sum(dim=-1, dtype=acc_dtype)
        p, p_tail = target_buckets(topk_logprobs[s:e], acc_dtype)
        kl = bucket_kl(p, p_tail, log_q, q_tail)
        ce_total += (-logp_label * w).sum()
        kl_total += (kl * w).sum()
        if need_grad:
            tail_ratio = p_tail / q_tail.clamp(min=TAIL_FLOOR)
            # j not in K: w q_j (1 - a p_tail / q_tail); j in K: w (q_j - a p_j); label: w (q - 1 + a (1 - m))
            probs.mul_((w * (1.0 - a * tail_ratio))[:, None].to(probs.dtype))
            probs.scatter_(1, ids, (w[:, None] * (log_q.exp() - a * p)).to(probs.dtype))
            in_topk = ids == lab[:, None]
            p_label = (p * in_topk).sum(dim=-1)
            m = torch.where(in_topk.any(dim=-1), p_label, logp_label.exp() * tail_ratio)
            probs[rows, lab] = (w * (torch.expm1(logp_label) + a * (1.0 - m))).to(probs.dtype)
            grad_hidden[s:e] = probs @ head
    if need_grad:
        ctx.save_for_backward(grad_hidden)
    total = (1.0 - a) * ce_total + a * kl_total
    ctx.mark_non_differentiable(correct, ce_total, kl_total)
    return total, correct, ce_total, kl_total


def chunked_head_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      chunk: int = 256, topk_ids: torch.Tensor | None = None,
                      topk_logprobs: torch.Tensor | None = None, soft_weight: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sum of weight x CE, or with a = soft_weight > 0 and the target's top-k ids and log-probs [T, K] per row of
    weight x ((1 - a) CE + a KL); greedy-correct [T]; sum of weight x CE; sum of weight x KL or None) for hidden
    [T, H] and head [V, H]. Only the first carries a gradient (see _ChunkedHeadCE)."""
    return _ChunkedHeadCE.apply(hidden, head, labels, weights, chunk, topk_ids, topk_logprobs, float(soft_weight))


# --- the loss ---------------------------------------------------------------------------------------------------


@dataclass
class LossOutput:
    loss: torch.Tensor  # weighted mean CE (scalar, differentiable)
    weight_sum: torch.Tensor  # sum of the weights (the normaliser)
    correct: torch.Tensor  # [B] correct greedy predictions per slot (supervised slots only)
    counted: torch.Tensor  # [B] supervised slots per position
    num_blocks: int
    ce: torch.Tensor | None = None  # weighted mean hard-label CE (detached)
    kl: torch.Tensor | None = None  # weighted mean K+1-bucket KL to the target (detached); None without soft labels


def draft_hidden(drafter, embed: torch.Tensor, batch: dict[str, torch.Tensor], blocks: Blocks,
                 mask_token_id: int, attention: str) -> torch.Tensor:
    """The drafter's final hidden states for every block slot, [b, N*B, H]."""
    input_ids = batch["input_ids"]
    S = input_ids.shape[1]
    ids = block_input_ids(input_ids, blocks, mask_token_id)
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).expand(input_ids.shape[0], -1)
    block_embeds = F.embedding(ids, embed)
    dtype = next(drafter.parameters()).dtype
    mask, attention_fn = attention_for(blocks, S, attention)
    return drafter(position_ids=torch.cat([position_ids, block_position_ids(position_ids, blocks)], dim=1),
                   noise_embedding=block_embeds.to(dtype), target_hidden=batch["hidden_states"].to(dtype),
                   attention_mask=mask, attention_fn=attention_fn)


def draft_rows(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each target id's row in a draft vocabulary's head (`ids`, the sorted target ids it drafts: row r drafts
    ids[r], as the exported `d2t` says), -1 for an id outside it: [vocab_size]."""
    rows = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    rows[ids] = torch.arange(len(ids), device=ids.device)
    return rows


def dflash_loss(drafter, embed: torch.Tensor, lm_head: torch.Tensor, batch: dict[str, torch.Tensor],
                blocks: Blocks, *, mask_token_id: int, gamma: float, attention: str = "sdpa",
                head_chunk_tokens: int = 256, soft_label_weight: float = 0.0,
                label_rows: torch.Tensor | None = None) -> LossOutput:
    """The decay-weighted block loss for one micro batch (see the module docstring): CE, or with
    soft_label_weight a > 0 the (1 - a) CE + a KL mix against batch["topk_ids"] / batch["topk_logprobs"].
    `label_rows` (`draft_rows`): `lm_head` is a draft vocabulary's rows, each label becomes its row there, and a
    label outside it (which the drafter cannot draft) gets no loss and is not counted."""
    if soft_label_weight > 0 and "topk_ids" not in batch:
        raise ValueError("soft_label_weight > 0 needs batch['topk_ids'] and batch['topk_logprobs'] (a store "
                         "captured with --store-topk)")
    if soft_label_weight > 0 and label_rows is not None:
        raise ValueError("soft labels are the target's top-k over its whole vocabulary: not with a draft vocabulary")
    doc_start = batch.get("doc_start")
    labels, weights = block_labels(batch["input_ids"], batch["loss_mask"], blocks, gamma, doc_start)
    if label_rows is not None:
        labels = label_rows[labels]
        weights = weights * (labels >= 0)
        labels = labels.clamp(min=0)
    hidden = draft_hidden(drafter, embed, batch, blocks, mask_token_id, attention)
    B = blocks.block_size
    flat_w = weights.reshape(-1)
    rows = flat_w.nonzero()[:, 0]  # only supervised slots go through the head
    weight_sum = flat_w.sum()
    # the head's dtype (a no-op when they match; an fp32 drafter under bf16 mixed precision meets a bf16 head)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows).to(lm_head.dtype)
    row_w = flat_w[rows] / weight_sum.clamp(min=1e-9)
    if soft_label_weight > 0:
        top_ids, top_logp = block_topk(batch["topk_ids"], batch["topk_logprobs"], blocks)
        K = top_ids.shape[-1]
        total, hit, ce, kl = chunked_head_loss(h, lm_head, labels.reshape(-1)[rows], row_w, head_chunk_tokens,
                                               top_ids.reshape(-1, K)[rows], top_logp.reshape(-1, K)[rows],
                                               soft_label_weight)
    else:
        total, hit, ce, kl = chunked_head_loss(h, lm_head, labels.reshape(-1)[rows], row_w, head_chunk_tokens)
    slot = rows % B
    correct = torch.zeros(B, device=h.device).index_add_(0, slot, hit.float())
    counted = torch.zeros(B, device=h.device).index_add_(0, slot, torch.ones_like(slot, dtype=torch.float32))
    return LossOutput(loss=total, weight_sum=weight_sum, correct=correct, counted=counted,
                      num_blocks=int(blocks.keep.sum()), ce=ce, kl=kl)


# --- simulated acceptance --------------------------------------------------------------------------------------


@torch.no_grad()
def simulated_acceptance(drafter, embed: torch.Tensor, lm_head: torch.Tensor, sample: SampleTensors,
                         block_size: int | None = None, mask_token_id: int | None = None,
                         max_blocks: int = 256, attention: str = "blockwise",
                         confidence: list[float] | None = None, draft_ids: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Acceptance length at every anchor of one captured sample, [num_anchors] long in 1..B (with `confidence`, a
    list, the drafter's probability of its first draft at each anchor is appended to it: what a speculator knows
    before the target verifies). `draft_ids`: `lm_head` is a draft vocabulary's rows, and row r drafts
    draft_ids[r] (training; an exported drafter carries its own, `DFlashDraftModel.logits`).

    A block starts at every position a where loss_mask[a] and loss_mask[a+1]; it sees the captured context
    before a; its greedy drafts for slots 1..B-1 are checked against the target's own tokens. Accepted length
    = 1 (the token the target always contributes) + the number of leading correct drafts, so at most B. A
    draft slot past the end of the captured response cannot be verified and ends the run."""
    B = block_size or drafter.block_size
    mask_id = drafter.mask_token_id if mask_token_id is None else mask_token_id
    device = next(drafter.parameters()).device
    ids = sample["input_ids"].to(device)[None]
    loss_mask = sample["loss_mask"].to(device)[None]
    states = sample["hidden_states"].to(device)[None]
    S = ids.shape[1]
    every = all_anchors(loss_mask, B)
    accepted = []
    for s in range(0, every.num_blocks, max_blocks):
        blocks = make_blocks(every.anchors[:, s:s + max_blocks], every.keep[:, s:s + max_blocks], B)
        batch = {"input_ids": ids, "loss_mask": loss_mask, "hidden_states": states}
        hidden = draft_hidden(drafter, embed, batch, blocks, mask_id, attention)  # [1, n*B, H]
        n = blocks.num_blocks
        preds = torch.empty(n * B, dtype=torch.long, device=device)
        for c in range(0, n * B, 2048):
            preds[c:c + 2048] = drafter.logits(hidden[0, c:c + 2048], lm_head).argmax(dim=-1)
        if draft_ids is not None:
            preds = draft_ids[preds]
        if confidence is not None:
            first = drafter.logits(hidden[0].view(n, B, -1)[:, 1].float(), lm_head)
            confidence += first.softmax(dim=-1).amax(dim=-1).tolist()
        idx = blocks.anchors[0][:, None] + torch.arange(B, device=device)  # [n, B]
        inside = idx < S
        idx_c = idx.clamp(max=S - 1)
        ok = (preds.view(n, B) == ids[0, idx_c]) & inside & loss_mask[0, idx_c]
        ok = ok[:, 1:]
        accepted.append(1 + ok.long().cumprod(dim=1).sum(dim=1))
    if not accepted:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(accepted).cpu()


def decoded_steps(sample: SampleTensors, lengths: list[int], block_size: int, k: int | None = None) -> list[int]:
    """The acceptance lengths greedy speculative decoding of `sample`'s response would take, from
    simulated_acceptance's `lengths` at every anchor: the first step at the first anchor, each next one at the
    anchor after the tokens the last one committed, each at most K + 1 (K drafts verified; default B - 1).

    Decoding visits one anchor in tau, and the anchors it skips are the ones inside the runs the drafter gets right:
    the mean over every anchor weighs those runs once per token and overstates tau wherever easy and hard stretches
    alternate (a structured answer: fixed keys and punctuation around free text). On the triage log's 20 held-out
    answers: 3.45 over every anchor, 2.01 along the decoding walk, 2.14 in vLLM (BENCHMARKS.md)."""
    positions = all_anchors(sample["loss_mask"][None], block_size).anchors[0].tolist()
    assert len(positions) == len(lengths), "lengths are simulated_acceptance's, one per anchor of the sample"
    cap = block_size if k is None else k + 1
    capped = [min(length, cap) for length in lengths]
    return [capped[i] for i in decoding_walk(positions, capped)]


def decoding_walk(positions: list[int], committed: list[int]) -> list[int]:
    """The anchors greedy decoding visits (their indices), given at each anchor (`positions`, in order) the tokens
    a step from it commits: the first, then each next one at the position the last step reached; past a response's
    end the next response (multi-turn) starts its own walk at its first anchor."""
    visited, next_anchor = [], -1
    for i, (position, length) in enumerate(zip(positions, committed)):
        if position >= next_anchor:
            visited.append(i)
            next_anchor = position + length
    return visited
