"""The combined speculator in vLLM: the DFlash drafter where it predicts, prompt lookup where the answer repeats its
context, in one engine. A `vllm.general_plugins` plugin (`register`, the package's entry point: vLLM calls it in
every process before it builds an engine).

Each step the DFlash drafter drafts its block as it always does (it reads the target's states of every verified
token, so it runs at every step whichever block is verified, and its draft cache stays whole). Then, per request,
where prompt lookup (`lookup.lookup_match`, vLLM's n-gram rule, on the context including this step's tokens) matched
and the drafter's probability of its first draft is below the rule's confidence (`lookup.CombinedRule`), the
lookup's block, at most the rule's k tokens, is verified instead. vLLM verifies draft lists of different lengths
per request (its n-gram proposer hands it such lists), and verification keeps the longest prefix the target agrees
with, so greedy output is plain decoding's whichever block it checks.

Turned on per engine by the environment: DFLASH_TRAIN_LOOKUP (`lookup.COMBINED_SETTING`, e.g. "k=4,confidence=0.6")
with a `dflash` speculative config, read when the engine drafts its first block:

    DFLASH_TRAIN_LOOKUP=k=4,confidence=0.6 vllm serve TARGET --speculative-config \\
        '{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": 9}'

It stays off, saying why in one line, for a vLLM other than the one it was written against (VLLM_SERIES: it wraps
the model runner's drafting step, which other versions lay out differently), for a speculator other than dflash,
under async scheduling (drafts stay on the device there; vLLM's default on GPUs: pass --no-async-scheduling) and
where the drafter samples its drafts (a lookup block has no draft probabilities for the rejection sampler).
Which block each step verified, and how many of its tokens the target kept, are counted per source
(`source_counts`, read with `LLM.collective_rpc(source_counts)`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

from dflash_train.lookup import COMBINED_SETTING, CombinedRule, lookup_match, parse_combined

VLLM_SERIES = "0.32."  # the vLLM releases whose model runner this plugin wraps
SOURCES = ("drafter", "lookup")
STATE = "_dflash_train_combined"  # the model runner's attribute holding its Combined (None: off)
log = logging.getLogger("vllm.dflash_train.combined")


@dataclass
class Combined:
    """One engine's combined speculator: its rule, the source of each request's pending block, and per source the
    blocks verified, the tokens drafted in them and the tokens the target kept."""
    rule: CombinedRule
    pending: dict[str, str] = field(default_factory=dict)  # request id -> the source of its block in flight
    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: {s: {"blocks": 0, "drafted": 0, "accepted": 0} for s in SOURCES})

    def settle(self, req_ids: list[str], new_tokens: list[list[int]], drafted: list[int]) -> None:
        """Count the blocks the step just verified: request i had drafted[i] drafts in flight and the step
        committed new_tokens[i], its accepted drafts and the target's own next token."""
        for req_id, tokens, n in zip(req_ids, new_tokens, drafted):
            source = self.pending.get(req_id)
            if source is None or n == 0:
                continue
            count = self.counts[source]
            count["blocks"] += 1
            count["drafted"] += n
            count["accepted"] += max(len(tokens) - 1, 0)

    def choose(self, drafts: list[list[int]], first_p: list[float], contexts: list[np.ndarray | None],
               req_ids: list[str]) -> list[list[int]]:
        """Each request's block to verify: lookup's where the rule picks it, else the drafter's (`drafts`).
        contexts[i] is request i's tokens so far (None: it decodes nothing this step)."""
        self.pending = {}
        blocks = []
        for req_id, block, p, context in zip(req_ids, drafts, first_p, contexts, strict=True):
            source = "drafter"
            if context is not None:
                looked, matched = lookup_match(context, min(self.rule.k, len(block)))
                if looked and self.rule.picks_lookup(matched, p):
                    block, source = looked, "lookup"
            self.pending[req_id] = source
            blocks.append(block)
        return blocks


def source_counts(worker) -> dict[str, dict[str, int]] | None:
    """Per source, the blocks this worker's engine verified, their drafts and the tokens kept (None: combined
    speculator off). For `LLM.collective_rpc(source_counts)`."""
    combined = getattr(worker.model_runner, STATE, None)
    return {source: dict(count) for source, count in combined.counts.items()} if combined else None


def register() -> None:
    """vLLM's plugin entry point: wrap the model runner's drafting step and DFlash's greedy draft sampling, for the
    vLLM this plugin knows; otherwise nothing (and one line, where the combined speculator was asked for)."""
    import vllm

    if not vllm.__version__.startswith(VLLM_SERIES):
        if os.environ.get(COMBINED_SETTING):
            log.warning("dflash-train combined speculator off: written for vLLM %s*, this is vLLM %s (%s ignored)",
                        VLLM_SERIES, vllm.__version__, COMBINED_SETTING)
        return
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.propose_draft_token_ids, "_dflash_train", False):
        return  # registered already in this process
    propose, greedy = GPUModelRunner.propose_draft_token_ids, DFlashProposer._greedy_sample

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        combined = _combined(self)  # before drafting: DFlash's sampling then records its first drafts' p
        drafts = propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                         sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                         slot_mappings)
        if combined is None:
            return drafts
        batch = self.input_batch
        req_ids, n = list(batch.req_ids), batch.num_reqs
        rows = sampled_token_ids.tolist() if hasattr(sampled_token_ids, "tolist") else sampled_token_ids
        new_tokens = [[t for t in row if t >= 0] for row in rows[:n]]  # rejected slots are -1
        drafted = list(spec_decode_metadata.num_draft_tokens) if spec_decode_metadata is not None else [0] * n
        combined.settle(req_ids, new_tokens, drafted)
        discard = self.discard_request_mask.np[:n]
        contexts = [None if discard[i] or not new_tokens[i] else
                    np.concatenate([batch.token_ids_cpu[i, :batch.num_tokens_no_spec[i]],
                                    np.asarray(new_tokens[i], dtype=batch.token_ids_cpu.dtype)])
                    for i in range(n)]
        first_p = self.drafter._dflash_train_first_p
        return combined.choose(drafts[:n].tolist(), first_p[:n], contexts, req_ids)

    def _greedy_sample(self, hidden_states):
        if getattr(self, STATE, None) is None:
            return greedy(self, hidden_states)
        logits = self.model.compute_logits(hidden_states)
        first = logits.view(-1, self.num_speculative_tokens, logits.shape[-1])[:, 0]
        self._dflash_train_first_p = first.float().softmax(dim=-1).amax(dim=-1).tolist()
        return logits.argmax(dim=-1)

    propose_draft_token_ids._dflash_train = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    DFlashProposer._greedy_sample = _greedy_sample


def _combined(runner) -> Combined | None:
    """The runner's combined speculator, set up at its first drafting step from COMBINED_SETTING (None: off)."""
    if STATE in runner.__dict__:
        return runner.__dict__[STATE]
    combined = None
    setting = os.environ.get(COMBINED_SETTING)
    if setting:
        why_not = _why_off(runner)
        if why_not:
            log.warning("dflash-train combined speculator off: %s (%s=%s ignored)", why_not, COMBINED_SETTING,
                        setting)
        else:
            combined = Combined(parse_combined(setting))
            log.info("dflash-train combined speculator on: %s", combined.rule.setting())
    setattr(runner, STATE, combined)
    if combined is not None:
        setattr(runner.drafter, STATE, combined)  # DFlash's sampling records its first drafts' probabilities
    return combined


def _why_off(runner) -> str | None:
    spec = runner.speculative_config
    if spec is None or not spec.use_dflash():
        return f"it combines a dflash drafter with lookup, the speculator here is {getattr(spec, 'method', None)}"
    if runner.use_async_scheduling:
        return "async scheduling keeps drafts on the device (serve with --no-async-scheduling)"
    drafter = runner.drafter
    if drafter.use_local_argmax_reduction or drafter.use_heterogeneous_vocab:
        return "the drafter's tokens are not sampled from its full logits here"
    if drafter._enable_probabilistic_draft_probs:
        return "the drafter samples its drafts (a lookup block has no draft probabilities)"
    return None
