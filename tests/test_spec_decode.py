"""Speculative decoding reproduces plain decoding token for token, whatever the proposer drafts."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_train.spec_decode.loop import (DFlashProposer, NoDraft, TokenChooser, plain_generate,
                                           speculative_generate)

PROMPTS = ["Hello! How can I help", "def add(a, b):", "Write a poem about the sea.", "0123456789 + - *"]


def prompt_ids(target, text: str) -> list[int]:
    return target.render([{"role": "user", "content": text}])


class Oracle:
    """Drafts the target's own continuation. `reference` is prompt + what the target decodes with the same
    chooser and no stop token, long enough for every block; slots past `horizon` get a token that is certainly
    wrong (the right one + 1), so every step accepts exactly `horizon` drafts. With `noise`, each slot is
    instead wrong with that probability (seeded), for varied acceptance lengths."""
    layer_ids: list[int] = []

    def __init__(self, reference: list[int], block_size: int, vocab: int, horizon: int | None = None,
                 noise: float = 0.0, seed: int = 0, strict: bool = True):
        self.strict = strict  # assert that decoding follows `reference`
        self.reference, self.block_size, self.vocab = reference, block_size, vocab
        self.horizon = block_size - 1 if horizon is None else horizon
        self.noise, self.rng = noise, random.Random(seed)
        self.drafted: list[tuple[int, list[int]]] = []  # (anchor position, drafts) of every online step

    def drafts_at(self, seq: list[int], anchor: int) -> list[int]:
        right = seq[anchor + 1: anchor + self.block_size]
        assert len(right) == self.block_size - 1, "reference too short for this block"
        wrong = [k >= self.horizon or self.rng.random() < self.noise for k in range(len(right))]
        return [(t + 1) % self.vocab if w else t for t, w in zip(right, wrong)]

    def begin(self, prompt_ids, tapped):
        assert prompt_ids.tolist() == self.reference[:len(prompt_ids)]

    def propose(self, ids):
        if self.strict:
            assert ids.tolist() == self.reference[:len(ids)], "decoding left the target's own continuation"
        drafts = self.drafts_at(self.reference, len(ids) - 1)
        self.drafted.append((len(ids) - 1, drafts))
        return drafts

    def advance(self, tapped):
        assert tapped is None


def reference(target, ids: list[int], n: int, chooser: TokenChooser | None = None) -> list[int]:
    return ids + plain_generate(target.model, ids, n, stop_ids=[], chooser=chooser).tokens


def test_plain_generate_equals_transformers_generate(tiny_target):
    model = tiny_target.model
    for text in PROMPTS[:2]:
        ids = prompt_ids(tiny_target, text)
        ours = plain_generate(model, ids, 24, tiny_target.stop_token_ids()).tokens
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                eos_token_id=tiny_target.stop_token_ids(), pad_token_id=2)[0, len(ids):].tolist()
        assert ours == theirs
        assert len(set(ours)) > 3, "the test target should not be degenerate"


def test_block_size_one_is_plain_decoding(tiny_target):
    ids = prompt_ids(tiny_target, PROMPTS[1])
    plain = plain_generate(tiny_target.model, ids, 20, [2])
    spec = speculative_generate(tiny_target.model, ids, NoDraft(), 20, [2])
    assert spec.tokens == plain.tokens
    assert [(s.accepted, s.committed) for s in spec.steps] == [(0, 1)] * (len(plain.tokens) - 1)


@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_oracle_accepts_whole_blocks(tiny_target, block_size):
    model, vocab = tiny_target.model, tiny_target.config.vocab_size
    for text in PROMPTS:
        ids = prompt_ids(tiny_target, text)
        n = 23
        oracle = Oracle(reference(tiny_target, ids, n + block_size), block_size, vocab)
        plain = plain_generate(model, ids, n, [])
        spec = speculative_generate(model, ids, oracle, n, [])
        assert spec.tokens == plain.tokens
        assert all(s.accepted == block_size - 1 for s in spec.steps)
        assert all(s.committed == block_size for s in spec.steps[:-1])  # every full step: tau == B
        assert sum(s.committed for s in spec.steps) == n - 1  # the first token comes from the prefill
        assert len(spec.steps) == -(-(n - 1) // block_size)


def test_stop_token_and_length_cut_inside_accepted_blocks(tiny_target):
    model, vocab, B = tiny_target.model, tiny_target.config.vocab_size, 4
    ids = prompt_ids(tiny_target, PROMPTS[2])
    ref = reference(tiny_target, ids, 40 + B)
    continuation = ref[len(ids):]
    cuts = 0
    for stop_index in range(2, 14):  # a stop token at every slot of a few blocks
        stop = [continuation[stop_index]]
        for noise in (0.0, 0.3):
            oracle = Oracle(ref, B, vocab, noise=noise, seed=stop_index)
            plain = plain_generate(model, ids, 40, stop)
            spec = speculative_generate(model, ids, oracle, 40, stop)
            assert spec.tokens == plain.tokens and spec.stopped and plain.stopped
            assert spec.tokens[-1] == stop[0] and stop[0] not in spec.tokens[:-1]
            cuts += spec.steps[-1].committed < spec.steps[-1].accepted + 1
            assert all(s.tau == 1 + s.accepted for s in spec.steps)
    assert cuts > 0, "no stop token fell inside an accepted block"
    for max_new in range(1, 12):  # the length limit at every slot
        plain = plain_generate(model, ids, max_new, [])
        spec = speculative_generate(model, ids, Oracle(ref, B, vocab), max_new, [])
        assert spec.tokens == plain.tokens and len(spec.tokens) == max_new


def test_horizon_oracle_and_noisy_oracle_are_lossless(tiny_target):
    model, vocab, B = tiny_target.model, tiny_target.config.vocab_size, 5
    for text in PROMPTS:
        ids = prompt_ids(tiny_target, text)
        ref = reference(tiny_target, ids, 30 + B)
        plain = plain_generate(model, ids, 30, [2]).tokens
        for horizon in range(B):
            spec = speculative_generate(model, ids, Oracle(ref, B, vocab, horizon=horizon), 30, [2])
            assert spec.tokens == plain
            assert all(s.accepted == horizon for s in spec.steps)
        spec = speculative_generate(model, ids, Oracle(ref, B, vocab, noise=0.25, seed=1), 30, [2])
        assert spec.tokens == plain
        assert len({s.accepted for s in spec.steps}) > 1


def test_sampling_accepts_only_drafts_equal_to_the_targets_sample(tiny_target):
    model, vocab, B = tiny_target.model, tiny_target.config.vocab_size, 4
    ids = prompt_ids(tiny_target, PROMPTS[0])
    greedy = plain_generate(model, ids, 30, []).tokens
    outputs = []
    for seed in (1, 2):
        chooser = TokenChooser(temperature=1.0, seed=seed)
        plain = plain_generate(model, ids, 30, [], chooser=chooser).tokens
        assert plain == plain_generate(model, ids, 30, [], chooser=chooser).tokens  # seeded: reproducible
        ref = reference(tiny_target, ids, 30 + B, chooser)
        oracle = Oracle(ref, B, vocab, noise=0.3, seed=seed)
        spec = speculative_generate(model, ids, oracle, 30, [], chooser=chooser)
        assert spec.tokens == plain
        for (anchor, drafts), step in zip(oracle.drafted, spec.steps):  # ref: the target's samples
            assert drafts[:step.accepted] == ref[anchor + 1: anchor + 1 + step.accepted]
            if step.accepted < B - 1:
                assert drafts[step.accepted] != ref[anchor + 1 + step.accepted]  # the rejected draft
        assert any(s.accepted > 0 for s in spec.steps) and any(s.accepted < B - 1 for s in spec.steps)
        # a proposer that drafts the greedy continuation is rejected where the sample differs from it
        greedy_oracle = Oracle(ids + greedy + [0] * B, B, vocab, strict=False)
        wrong = speculative_generate(model, ids, greedy_oracle, 30, [], chooser=chooser)
        assert wrong.tokens == plain
        outputs.append(plain)
    assert outputs[0] != outputs[1] and greedy not in outputs


def tiny_drafter(target, block_size: int = 4, num_layers: int = 1, seed: int = 0):
    """(model, config) of an untrained tiny drafter tapping layers 1, 4, 6."""
    from tiny import make_tiny_drafter

    drafter, config = make_tiny_drafter(target.config, target.tokenizer, num_layers=num_layers,
                                        block_size=block_size, seed=seed, target_layer_ids=[1, 4, 6])
    return drafter.float().eval(), config


class Recorder:
    """Wraps a proposer and keeps the anchor position and drafts of every step."""

    def __init__(self, inner):
        self.inner, self.block_size, self.layer_ids = inner, inner.block_size, inner.layer_ids
        self.drafted: list[tuple[int, list[int]]] = []

    def begin(self, prompt_ids, tapped):
        self.inner.begin(prompt_ids, tapped)

    def propose(self, ids):
        drafts = self.inner.propose(ids)
        self.drafted.append((len(ids) - 1, drafts))
        return drafts

    def advance(self, tapped):
        self.inner.advance(tapped)


def test_untrained_dflash_drafter_is_lossless_and_drafts_like_training(tiny_target):
    from dflash_train.model.masks import make_blocks
    from dflash_train.objective import draft_hidden

    model = tiny_target.model
    drafter, _ = tiny_drafter(tiny_target)
    proposer = Recorder(DFlashProposer(drafter, model.get_input_embeddings(), model.lm_head))
    layers = [i + 1 for i in drafter.target_layer_ids]
    for text in PROMPTS[:3]:
        ids = prompt_ids(tiny_target, text)
        proposer.drafted.clear()
        plain = plain_generate(model, ids, 24, [2])
        spec = speculative_generate(model, ids, proposer, 24, [2])
        assert spec.tokens == plain.tokens
        # the same drafts from the training path: a teacher-forced target forward over the final sequence,
        # then all the online anchors' blocks in one drafter forward with the block mask
        full = torch.tensor([ids + spec.tokens])
        with torch.no_grad():
            states = model(full, output_hidden_states=True).hidden_states
            batch = {"input_ids": full, "hidden_states": torch.cat([states[i] for i in layers], dim=-1)}
            anchors = torch.tensor([[a for a, _ in proposer.drafted]])
            blocks = make_blocks(anchors, torch.ones_like(anchors, dtype=torch.bool), drafter.block_size)
            hidden = draft_hidden(drafter, model.get_input_embeddings().weight, batch, blocks,
                                  drafter.mask_token_id, "sdpa")
            B = drafter.block_size
            drafts = model.lm_head(hidden[0]).view(-1, B, model.config.vocab_size)[:, 1:].argmax(dim=-1)
        assert drafts.tolist() == [d for _, d in proposer.drafted]


def test_a_step_cut_by_a_stop_token_counts_1_plus_its_accepted_drafts_in_both_loops(tiny_target):
    """The acceptance length on the last step, where a stop token inside the accepted drafts ends the output, is
    pinned to z-lab/dflash (which appends acceptance_length + 1 for every verification step): 1 + the drafts the
    target accepted, not the tokens committed (the shipped spec_generate used to say) nor 1 + min(accepted,
    committed) (spec_decode used to say). Both loops here draft with the same oracle and count alike."""
    import types

    from tiny import make_tiny_drafter

    model, vocab, B = tiny_target.model, tiny_target.config.vocab_size, 4
    ids = prompt_ids(tiny_target, PROMPTS[2])
    ref = reference(tiny_target, ids, 40 + B)
    stop = [ref[len(ids) + 6]]  # the 7th new token: inside the third block (steps commit 4 tokens each)
    assert stop[0] not in ref[len(ids):len(ids) + 6]
    spec = speculative_generate(model, ids, Oracle(ref, B, vocab), 40, stop)
    last = spec.steps[-1]
    assert spec.tokens == ref[len(ids):len(ids) + 7] and last.committed < last.accepted + 1 == B
    assert [s.tau for s in spec.steps] == [B, B]

    embed = model.get_input_embeddings().weight.detach()
    table = torch.tensor(ref)
    assert torch.equal((embed[table] @ embed.t()).argmax(-1), table)  # the LM head reads a row back as its token

    def oracle_forward(self, position_ids, noise_embedding=None, target_hidden=None, **kwargs):
        """Hidden state of slot k = the target's embedding of its own token at that position."""
        return embed[table[position_ids[0, -noise_embedding.shape[1]:]]][None]

    drafter, _ = make_tiny_drafter(tiny_target.config, tiny_target.tokenizer, num_layers=1, block_size=B,
                                   target_layer_ids=[1])
    drafter.forward = types.MethodType(oracle_forward, drafter)
    lengths = []
    out = drafter.spec_generate(target=model, input_ids=torch.tensor([ids]), max_new_tokens=40,
                                stop_token_ids=stop, acceptance_lengths=lengths)
    assert out[0, len(ids):].tolist() == spec.tokens
    assert lengths == [s.tau for s in spec.steps]



@pytest.mark.parametrize("constraints", [
    {"structured": {"kind": "regex", "spec": "([a-z]+ ){3,8}[a-z]+\\."}},
    {"structured": {"kind": "json_schema", "spec": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                    "required": ["n"]}}},
    {"stop": None, "repetition_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"5": 3.0}},
], ids=["regex", "json_schema", "settings"])
def test_speculative_decoding_under_a_requests_constraints_equals_plain_decoding_under_them(tiny_target,
                                                                                        constraints):
    from dflash_train.constraints import Rules

    if "structured" in constraints:
        pytest.importorskip("xgrammar")
    model, tok, stop = tiny_target.model, tiny_target.tokenizer, tiny_target.stop_token_ids()
    drafter, _ = tiny_drafter(tiny_target)
    accepted, stopped_by_string = 0, 0
    for text in PROMPTS:
        ids = prompt_ids(tiny_target, text)
        c = dict(constraints)
        if "stop" in c:  # a stop string from the middle of what the target says under the rest
            rest = {k: v for k, v in c.items() if k != "stop"}
            rest_rules = Rules(rest, tok, tiny_target.config.vocab_size, stop, ids)
            said = tok.decode(plain_generate(model, ids, 40, stop, rules=rest_rules).tokens, skip_special_tokens=True)
            c["stop"] = [said[len(said) // 3: len(said) // 3 + 3]]

        def rules():
            return Rules(c, tok, tiny_target.config.vocab_size, stop, ids)

        plain = plain_generate(model, ids, 40, stop, rules=rules())
        stopped_by_string += "stop" in c and plain.stopped and plain.tokens[-1] not in stop
        continuation = ids + plain.tokens + [0] * 8  # drafts: the constrained answer, a third of the slots wrong
        oracle = Oracle(continuation, 4, model.config.vocab_size, noise=0.3, strict=False)
        for proposer in (oracle, DFlashProposer(drafter, model.get_input_embeddings(), model.lm_head)):
            spec = speculative_generate(model, ids, proposer, 40, stop, rules=rules())
            assert spec.tokens == plain.tokens and spec.stopped == plain.stopped
            assert sum(s.committed for s in spec.steps) == len(spec.tokens) - 1
            accepted += sum(s.accepted for s in spec.steps) if proposer is oracle else 0
    assert accepted > 0
    assert stopped_by_string == (len(PROMPTS) if "stop" in constraints else 0)
