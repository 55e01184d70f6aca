"""Speculative decoding with a block drafter, and the plain decoding it must reproduce token for token.

One verification step: the proposer drafts B-1 tokens after the last committed token (the anchor); the target
runs once over the block [anchor, d_1 .. d_{B-1}] at positions anchor_pos .. anchor_pos+B-1; slot j's logits give
the target's own choice for position anchor_pos+j+1. The longest prefix of drafts equal to those choices is
accepted and the target's choice right after it (the bonus token) is committed too, so a step commits between
1 and B tokens. The target's KV cache is cropped back to the committed tokens, and the tapped hidden states of
the positions that are now final (the anchor and the accepted drafts) become the drafter's context.

Every committed token is the target's own choice given the committed prefix, so the output equals plain
decoding: greedy at temperature 0; at temperature > 0 the choice at absolute position p is a Gumbel-max sample
whose noise depends only on (seed, p), so plain and speculative sampling with one seed give the same tokens too.

A request's own constraints (`constraints.Rules`: a grammar, stop strings, penalties, logit bias) are applied to
the target's logits of each position in order, in both loops alike: in a verification step, slot j's logits are
processed with the rules advanced by the block's committed tokens before it, which are the accepted drafts.

Anything that drafts is a `Proposer`: the DFlash drafter, `NoDraft` (block size 1, plain decoding through the
same loop) and the oracle stubs of the tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash_train.model.modeling_dflash import cache_keyword, crop_cache, tap_layers
from dflash_train.target import new_cache


@dataclass
class Step:
    """One target verification."""
    accepted: int  # leading drafts equal to the target's own choices, 0 .. B-1
    committed: int  # tokens appended to the output: accepted + 1, fewer only where a stop token or the length cut

    @property
    def tau(self) -> int:
        """Acceptance length: 1 + the drafts the target accepted, at most B, as z-lab/dflash counts it (and the
        shipped module's spec_generate): also on the last step, where a stop token or the length limit cuts the
        output short of them. (Offline, objective.simulated_acceptance cannot check drafts past the end of the
        captured response; that is where the two estimates may differ.)"""
        return 1 + self.accepted


def mean_tau(steps: list[Step]) -> float | None:
    """One generation's tau: the mean over its verification steps (None for a generation with none)."""
    return sum(s.tau for s in steps) / len(steps) if steps else None


@dataclass
class Generation:
    tokens: list[int]  # new tokens only; a stop token that ended generation is included, as in plain decoding
    steps: list[Step] = field(default_factory=list)  # empty for plain decoding
    prefill_s: float = 0.0  # prompt forward, including the first token
    decode_s: float = 0.0  # everything after the first token: drafting, verification, bookkeeping
    draft_s: float = 0.0  # the part of decode_s spent in the proposer
    stopped: bool = False  # ended on a stop token (else on the length limit)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced in the decode phase (the first one comes from the prefill)."""
        return max(len(self.tokens) - 1, 0)


class TokenChooser:
    """The target's choice for absolute position p from the logits at p-1: argmax at temperature 0, else a
    Gumbel-max sample whose noise is drawn from a generator seeded with (seed, p). Keyed on the position, not
    on how many samples were drawn before, so that a verification step that throws draws away cannot shift the
    random stream, and speculative and plain decoding sample the very same tokens."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature = temperature
        self.seed = seed

    def __call__(self, logits: torch.Tensor, positions: list[int]) -> list[int]:
        """logits [n, V] -> one token per row; row i chooses the token at `positions[i]`."""
        if self.temperature == 0:
            return logits.argmax(dim=-1).tolist()
        scores = logits.float() / self.temperature
        noise = torch.stack([self._gumbel(p, scores.shape[-1]) for p in positions]).to(scores.device)
        return (scores + noise).argmax(dim=-1).tolist()

    def _gumbel(self, position: int, vocab: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (2 ** 63))
        u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-20, 1.0 - 1e-16)
        return (-torch.log(-torch.log(u))).float()


class Proposer(Protocol):
    """Drafts the next B-1 tokens. The decoding loop calls `begin` once after the prefill, then alternately
    `propose` and `advance`."""
    block_size: int
    layer_ids: list[int]  # target layers whose outputs it reads (HF hidden_states[i + 1]); [] for none

    def begin(self, prompt_ids: torch.Tensor, tapped: torch.Tensor | None) -> None:
        """prompt_ids [S]; tapped [S, n*H]: the tapped states of every prompt position (None without layers)."""

    def propose(self, ids: torch.Tensor) -> list[int]:
        """ids: every committed token, prompt included; the last one is the anchor. Returns B-1 drafts for the
        positions after it, from context strictly before the anchor plus the anchor token."""

    def advance(self, tapped: torch.Tensor | None) -> None:
        """The tapped states [k, n*H] of the k positions that just became final: the anchor of the last
        `propose` and the drafts accepted after it."""


class NoDraft:
    """Block size 1: the speculative loop degenerates to plain decoding (one token per target forward)."""
    block_size = 1
    layer_ids: list[int] = []

    def begin(self, prompt_ids: torch.Tensor, tapped: torch.Tensor | None) -> None:
        pass

    def propose(self, ids: torch.Tensor) -> list[int]:
        return []

    def advance(self, tapped: torch.Tensor | None) -> None:
        pass


def target_forward(model, ids: list[int] | torch.Tensor, cache, start: int, layer_ids: list[int],
                   last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the target on `ids` at positions start.. with its KV cache. Returns logits [n, V] (or [1, V] for
    the last position only: a prefill needs no more, and a long prompt's full logits are large) and the tapped
    states [n, len(layer_ids) * H] (outputs of those decoder layers, HF hidden_states[i + 1]) or None."""
    device = model.device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    positions = torch.arange(start, start + ids.shape[1], device=device).view(1, -1)
    out = model(input_ids=ids, position_ids=positions, use_cache=True, output_hidden_states=bool(layer_ids),
                logits_to_keep=1 if last_logits_only else 0, **{cache_keyword(type(model)): cache})
    tapped = tap_layers(out.hidden_states, layer_ids)[0] if layer_ids else None
    return out.logits[0], tapped


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _check(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _ruled_choices(chooser: TokenChooser, logits: torch.Tensor, first: int, rules, drafts: list[int]
                   ) -> tuple[list[int], int | None]:
    """The target's choices for the positions first, first + 1, ... under a request's `rules`, slot by slot, each
    made after the rules have taken the choices before it; as long as the choices equal `drafts` (the last is the
    first that differs, or the bonus token). Returns them and the index of the one that completes a stop string."""
    choices: list[int] = []
    ended_at = None
    for j in range(logits.shape[0]):
        choice = chooser(rules.process(logits[j])[None], [first + j])[0]
        choices.append(choice)
        if rules.accept(choice) and ended_at is None:
            ended_at = j
        if j >= len(drafts) or drafts[j] != choice:
            break
    return choices, ended_at


@torch.inference_mode()
def plain_generate(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int],
                   chooser: TokenChooser | None = None, rules=None) -> Generation:
    """One token per target forward with a KV cache: the reference speculative decoding must reproduce. With
    `rules` (`constraints.Rules`) every token is chosen under the request's constraints; a stop string ends it."""
    _check(max_new_tokens)
    chooser = chooser or TokenChooser()
    stop = set(stop_ids)
    cache, n = new_cache(model), len(prompt_ids)
    t0 = _clock(model.device)
    logits, _ = target_forward(model, prompt_ids, cache, 0, [], last_logits_only=True)
    tokens, ended = _next_choice(chooser, logits, n, rules)
    t1 = _clock(model.device)
    while tokens[-1] not in stop and len(tokens) < max_new_tokens and not ended:
        logits, _ = target_forward(model, tokens[-1:], cache, n + len(tokens) - 1, [])
        choice, ended = _next_choice(chooser, logits, n + len(tokens), rules)
        tokens += choice
    return Generation(tokens=tokens, prefill_s=t1 - t0, decode_s=_clock(model.device) - t1,
                      stopped=tokens[-1] in stop or ended)


def _next_choice(chooser: TokenChooser, logits: torch.Tensor, position: int, rules) -> tuple[list[int], bool]:
    """The target's choice for `position` from the one row of `logits` before it (under `rules`, when given), and
    whether it completes a stop string."""
    if rules is None:
        return chooser(logits, [position]), False
    choices, ended_at = _ruled_choices(chooser, logits, position, rules, [])
    return choices, ended_at is not None


@torch.inference_mode()
def speculative_generate(model, prompt_ids: list[int], proposer: Proposer, max_new_tokens: int,
                         stop_ids: list[int], chooser: TokenChooser | None = None, rules=None) -> Generation:
    """Draft-then-verify decoding; the output equals `plain_generate`'s with the same chooser (and rules)."""
    _check(max_new_tokens)
    chooser = chooser or TokenChooser()
    stop, block_size, layers = set(stop_ids), proposer.block_size, list(proposer.layer_ids)
    device = model.device
    cache, n = new_cache(model), len(prompt_ids)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    t0 = _clock(device)
    logits, tapped = target_forward(model, ids, cache, 0, layers, last_logits_only=True)
    tokens, ended = _next_choice(chooser, logits, n, rules)
    proposer.begin(ids, tapped)
    t1 = _clock(device)
    steps: list[Step] = []
    draft_s = 0.0
    ids = torch.cat([ids, torch.tensor(tokens, dtype=torch.long, device=device)])
    while tokens[-1] not in stop and len(tokens) < max_new_tokens and not ended:
        anchor = len(ids) - 1  # position of the last committed token, not yet in the target's cache
        started = _clock(device)
        drafts = [int(t) for t in proposer.propose(ids)]
        draft_s += _clock(device) - started
        if len(drafts) != block_size - 1:
            raise RuntimeError(f"proposer returned {len(drafts)} drafts for block size {block_size}")
        logits, tapped = target_forward(model, [int(ids[-1])] + drafts, cache, anchor, layers)
        ended_at = None
        if rules is None:
            choices = chooser(logits, list(range(anchor + 1, anchor + 1 + block_size)))
        else:
            choices, ended_at = _ruled_choices(chooser, logits, anchor + 1, rules, drafts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        committed = 0
        for j, token in enumerate(drafts[:accepted] + [choices[accepted]]):
            tokens.append(token)
            committed += 1
            if token in stop or len(tokens) >= max_new_tokens or j == ended_at:
                ended = j == ended_at
                break
        steps.append(Step(accepted=accepted, committed=committed))
        ids = torch.cat([ids, torch.tensor(tokens[-committed:], dtype=torch.long, device=device)])
        crop_cache(cache, anchor + accepted + 1)
        proposer.advance(None if tapped is None else tapped[: accepted + 1])
    return Generation(tokens=tokens, steps=steps, prefill_s=t1 - t0, decode_s=_clock(device) - t1,
                      draft_s=draft_s, stopped=tokens[-1] in stop or ended)


class DFlashProposer:
    """The DFlash drafter as a proposer: one drafter forward per step over the block [anchor, MASK x (B-1)],
    with a context cache that holds the fused K/V of every final position before the anchor. The embedding
    and LM head are the target's (the head's rows for a drafter's draft vocabulary: `DFlashDraftModel.logits`)."""

    def __init__(self, drafter, embedding: torch.nn.Module, lm_head: torch.nn.Module, block_size: int | None = None):
        self.drafter = drafter
        self.embedding = embedding
        self.lm_head = lm_head
        self.block_size = int(block_size or drafter.block_size)
        self.layer_ids = [int(i) for i in drafter.target_layer_ids]
        self.mask_token_id = int(drafter.mask_token_id)
        self.cache = None
        self.pending: torch.Tensor | None = None  # tapped states of final positions not yet in the cache
        self.pending_start = 0

    def begin(self, prompt_ids: torch.Tensor, tapped: torch.Tensor | None) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()  # the drafter keeps only context K/V in it (see modeling_dflash)
        self.pending, self.pending_start = tapped, 0

    def propose(self, ids: torch.Tensor) -> list[int]:
        anchor = ids.shape[0] - 1
        device = self.embedding.weight.device
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = ids[-1]
        positions = torch.arange(anchor, anchor + self.block_size, device=device).view(1, -1)
        if self.pending_start + self.pending.shape[0] != anchor:
            raise RuntimeError(f"drafter context ends at position {self.pending_start + self.pending.shape[0]} "
                               f"but the anchor is at {anchor}")
        context = self.pending.to(device=device, dtype=self.embedding.weight.dtype)[None]
        context_positions = torch.arange(self.pending_start, anchor, device=device).view(1, -1)
        hidden = self.drafter(position_ids=torch.cat([context_positions, positions], dim=1),
                              noise_embedding=self.embedding(block), target_hidden=context,
                              past_key_values=self.cache)
        self.pending, self.pending_start = context[0, :0], anchor
        return self.drafter.logits(hidden[0, 1:], self.lm_head.weight).argmax(dim=-1).tolist()

    def advance(self, tapped: torch.Tensor | None) -> None:
        self.pending = torch.cat([self.pending, tapped.to(self.pending.dtype)])
