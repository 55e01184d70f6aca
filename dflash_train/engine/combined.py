"""The combined speculator in vLLM: the DFlash drafter where it predicts, prompt lookup where the answer repeats its
context, in one engine. A `vllm.general_plugins` plugin (`register`, the package's entry point: vLLM calls it in
every process before it builds an engine).

At each step, per request, prompt lookup (`lookup.lookup_match`, vLLM's n-gram rule, on the context including
this step's tokens) drafts its block, at most the rule's k tokens; where it matched and the drafter's probability of
its first draft is below the rule's confidence (`lookup.CombinedRule`), lookup's block is verified instead of the
drafter's. vLLM verifies draft lists of different lengths per request (its n-gram proposer hands it such lists), and
verification keeps the longest prefix the target agrees with, so greedy output is plain decoding's whichever block
it checks. The DFlash drafter reads the target's states of every verified token, so its cache takes the context's
K/V at every step; its drafting pass runs unless the step does not need it: at confidence 1 (lookup wherever it
matched) a step where lookup matched for every request skips it.

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
STATE = "_dflash_train_combined"  # the model runner's attribute holding its Combined (None: off)
log = logging.getLogger("vllm.dflash_train.combined")


@dataclass
class Combined:
    """One engine's combined speculator: its rule, the source of each request's pending block, and per source the
    blocks verified, the tokens drafted in them and the tokens the target kept (lookup's also: how many of its
    blocks were drafted at a step that skipped the drafter's pass)."""
    rule: CombinedRule
    pending: dict[str, tuple[str, bool]] = field(default_factory=dict)  # request id -> (source, drafter skipped)
    counts: dict[str, dict[str, int]] = field(default_factory=lambda: {
        "drafter": {"blocks": 0, "drafted": 0, "accepted": 0},
        "lookup": {"blocks": 0, "drafted": 0, "accepted": 0, "without_drafter": 0}})

    def settle(self, req_ids: list[str], new_tokens: list[list[int]], drafted: list[int]) -> None:
        """Count the blocks the step just verified: request i had drafted[i] drafts in flight and the step
        committed new_tokens[i], its accepted drafts and the target's own next token."""
        for req_id, tokens, n in zip(req_ids, new_tokens, drafted):
            if req_id not in self.pending or n == 0:
                continue
            source, skipped = self.pending[req_id]
            count = self.counts[source]
            count["blocks"] += 1
            count["drafted"] += n
            count["accepted"] += max(len(tokens) - 1, 0)
            if skipped:
                count["without_drafter"] += 1

    def look(self, contexts: list[np.ndarray | None], k: int) -> list[tuple[list[int], int] | None]:
        """Each request's lookup block (at most the rule's k and the engine's k tokens) and the n it matched;
        contexts[i] is request i's tokens so far (None: it decodes nothing this step, and gets None)."""
        return [None if c is None else lookup_match(c, min(self.rule.k, k)) for c in contexts]

    def skips_drafter(self, looked: list[tuple[list[int], int] | None]) -> bool:
        """Whether this step does without the drafter's drafts: the rule does not ask it where lookup matched, and
        lookup matched for every request that decodes (at least one)."""
        decoding = [match for match in looked if match is not None]
        return not self.rule.asks_drafter and bool(decoding) and all(n > 0 for _, n in decoding)

    def choose(self, drafts: list[list[int]], first_p: list[float] | None,
               looked: list[tuple[list[int], int] | None], req_ids: list[str]) -> list[list[int]]:
        """Each request's block to verify: lookup's (`looked`, from `look`) where the rule picks it, else the
        drafter's (`drafts`; first_p None: the step skipped the drafter, every decoding request takes lookup's)."""
        self.pending = {}
        blocks = []
        for i, (req_id, block, match) in enumerate(zip(req_ids, drafts, looked, strict=True)):
            source = "drafter"
            if match is not None and match[0] and self.rule.picks_lookup(
                    match[1], None if first_p is None else first_p[i]):
                block, source = match[0], "lookup"
            self.pending[req_id] = (source, first_p is None)
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
    import torch
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.propose_draft_token_ids, "_dflash_train", False):
        return  # registered already in this process
    propose, greedy = GPUModelRunner.propose_draft_token_ids, DFlashProposer._greedy_sample
    dflash_propose = DFlashProposer.propose

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        combined = _combined(self)  # before drafting: DFlash's sampling then records its first drafts' p
        if combined is None:
            return propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                           sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                           slot_mappings)
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
        looked = combined.look(contexts, self.drafter.num_speculative_tokens)
        skip = self.drafter._dflash_train_skip = combined.skips_drafter(looked)
        drafts = propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                         sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                         slot_mappings)
        first_p = None if skip else self.drafter._dflash_train_first_p[:n]
        return combined.choose(drafts[:n].tolist(), first_p, looked, req_ids)

    def propose_or_skip(self, **kwargs):
        """DFlashProposer.propose, at a step whose blocks are all lookup's: the drafter's cache still takes the
        K/V of the step's context states (DFlash drafts from them at later steps), its drafting pass is skipped."""
        if not getattr(self, "_dflash_train_skip", False):
            return dflash_propose(self, **kwargs)
        self._dflash_train_skip = False
        self._last_draft_probs = None
        cad = kwargs["common_attn_metadata"]
        num_tokens, _, _ = self.set_inputs_first_pass(
            target_token_ids=kwargs["target_token_ids"], next_token_ids=kwargs["next_token_ids"],
            target_positions=kwargs["target_positions"],
            target_hidden_states=self.model.combine_hidden_states(kwargs["target_hidden_states"]),
            token_indices_to_sample=kwargs["token_indices_to_sample"], cad=cad,
            num_rejected_tokens_gpu=kwargs.get("num_rejected_tokens_gpu"))
        self.build_model_inputs_first_pass(num_tokens, num_tokens, None)  # stores the context K/V
        return torch.zeros(cad.batch_size(), self.num_speculative_tokens, dtype=torch.int64, device=self.device)

    def _greedy_sample(self, hidden_states):
        if getattr(self, STATE, None) is None:
            return greedy(self, hidden_states)
        logits = self.model.compute_logits(hidden_states)
        first = logits.view(-1, self.num_speculative_tokens, logits.shape[-1])[:, 0]
        self._dflash_train_first_p = first.float().softmax(dim=-1).amax(dim=-1).tolist()
        return logits.argmax(dim=-1)

    propose_draft_token_ids._dflash_train = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    DFlashProposer.propose = propose_or_skip
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
