"""The combined speculator in vLLM: the DFlash drafter where it predicts, the suffix tree where the answer repeats
earlier answers, prompt lookup where it repeats its own context, in one engine. A `vllm.general_plugins` plugin
(`register`, the package's entry point: vLLM calls it in every process before it builds an engine).

At each step, per request: the suffix tree (`suffix.SuffixSource`, arctic-inference's, fed as vLLM's own `suffix`
proposer feeds it: the request's prompt, its answer so far, the answers this engine finished before) drafts a block
with its own score, the tokens it expects accepted; prompt lookup (`lookup.lookup_match`, vLLM's n-gram rule, on the
context including this step's tokens) drafts its block, at most the rule's k tokens; the rule (`lookup.CombinedRule`)
takes the suffix tree's block where its score reaches the rule's `suffix`, else lookup's where it matched and the
drafter's probability of its first draft is below the rule's confidence, else the drafter's. vLLM verifies draft
lists of different lengths per request (its n-gram and suffix proposers hand it such lists), and verification keeps
the longest prefix the target agrees with, so greedy output is plain decoding's whichever block it checks. The
DFlash drafter reads the target's states of every verified token, so its cache takes the context's K/V at every
step; its drafting pass runs unless the step does not need it: a step where every request's block is decided
without the drafter (the suffix tree's taken, or lookup's at confidence 1) skips it.

Turned on per engine by the environment: DFLASH_TRAIN_LOOKUP (`lookup.COMBINED_SETTING`, e.g.
"k=4,confidence=0.6,suffix=1"; no `suffix`: no suffix tree) with a `dflash` speculative config, checked when the
plugin loads (a bad value stops the engine's start) and read when the engine drafts its first block; the suffix
tree takes vLLM's `suffix_decoding_*` settings from the speculative config:

    DFLASH_TRAIN_LOOKUP=k=4,confidence=0.6,suffix=1 vllm serve TARGET --speculative-config \\
        '{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": 7}'

It stays off, saying why in one line, for a vLLM other than the one it was written against (VLLM_SERIES: it wraps
the model runner's drafting step, which other versions lay out differently), for a speculator other than dflash,
under async scheduling (drafts stay on the device there; vLLM's default on GPUs: pass --no-async-scheduling), where
the drafter samples its drafts (a free block has no draft probabilities for the rejection sampler) and, for a rule
with the suffix tree, where arctic-inference does not load. Which block each step verified, and how many of its
tokens the target kept, are counted per source (`source_counts`, read with `LLM.collective_rpc(source_counts)`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

from dflash_train.spec_decode.lookup import COMBINED_SETTING, CombinedRule, lookup_match, parse_combined
from dflash_train.spec_decode.suffix import NO_DRAFT, SuffixDraft, SuffixSettings, SuffixSource, suffix_problem

VLLM_SERIES = "0.32."  # the vLLM releases whose model runner this plugin wraps
STATE = "_dflash_train_combined"  # the model runner's attribute holding its Combined (None: off)
log = logging.getLogger("vllm.dflash_train.combined")


@dataclass
class Combined:
    """One engine's combined speculator: its rule, its suffix tree (where the rule has the suffix source), the source
    of each request's pending block, and per source the blocks verified, the tokens drafted in them and the tokens
    the target kept (the free sources' also: how many of their blocks were drafted at a step that skipped the
    drafter's pass)."""
    rule: CombinedRule
    suffix: SuffixSource | None = None
    pending: dict[str, tuple[str, bool]] = field(default_factory=dict)  # request id -> (source, drafter skipped)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self):
        free = ("lookup", "suffix") if self.rule.suffix is not None else ("lookup",)
        self.counts = {"drafter": {"blocks": 0, "drafted": 0, "accepted": 0},
                       **{name: {"blocks": 0, "drafted": 0, "accepted": 0, "without_drafter": 0} for name in free}}
        if self.rule.suffix is not None and self.suffix is None:
            self.suffix = SuffixSource()

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

    def suffix_drafts(self, req_ids: list[str], prompts: list[np.ndarray], new_tokens: list[list[int]],
                      contexts: list[np.ndarray | None], k: int, max_model_len: int) -> list[SuffixDraft | None]:
        """Each request's suffix tree draft (at most the engine's k tokens), the tree fed as vLLM's suffix proposer
        feeds it, every step and whichever block is verified (None: no suffix source, or the request decodes
        nothing this step)."""
        if self.suffix is None:
            return [None] * len(req_ids)
        drafts = [None if c is None else self.suffix.draft(req_id, prompt, tokens, c, k, max_model_len)
                  for req_id, prompt, tokens, c in zip(req_ids, prompts, new_tokens, contexts, strict=True)]
        self.suffix.finish_others(req_ids)
        return drafts

    def skips_drafter(self, looked: list[tuple[list[int], int] | None], suffixed: list[SuffixDraft | None]) -> bool:
        """Whether this step does without the drafter's drafts: no request that decodes (at least one) needs them."""
        decoding = [(match, draft or NO_DRAFT) for match, draft in zip(looked, suffixed) if match is not None]
        return bool(decoding) and not any(self.rule.needs_drafter(draft.score, len(draft.token_ids), match[1])
                                          for match, draft in decoding)

    def choose(self, drafts: list[list[int]], first_p: list[float] | None,
               looked: list[tuple[list[int], int] | None], suffixed: list[SuffixDraft | None],
               req_ids: list[str]) -> list[list[int]]:
        """Each request's block to verify: the suffix tree's or lookup's (`suffixed`, `looked`) where the rule
        picks it, else the drafter's (`drafts`; first_p None: the step skipped the drafter)."""
        self.pending = {}
        blocks = []
        for i, (req_id, block, match, draft) in enumerate(zip(req_ids, drafts, looked, suffixed, strict=True)):
            source = "drafter"
            if match is not None:
                draft = draft or NO_DRAFT
                source = self.rule.source(draft.score, len(draft.token_ids), match[1],
                                          None if first_p is None else first_p[i])
                block = {"suffix": draft.token_ids, "lookup": match[0]}.get(source, block)
            self.pending[req_id] = (source, first_p is None)
            blocks.append(block)
        return blocks


def source_counts(worker) -> dict[str, dict[str, int]] | None:
    """Per source, the blocks this worker's engine verified, their drafts and the tokens kept (None: combined
    speculator off). For `LLM.collective_rpc(source_counts)`."""
    combined = getattr(worker.model_runner, STATE, None)
    return {source: dict(count) for source, count in combined.counts.items()} if combined else None


def suffix_answers(worker) -> int | None:
    """How many answers this worker's combined speculator's suffix tree holds in its global cache (None: no tree).
    For `LLM.collective_rpc(suffix_answers)`: before a request, the answers the engine produced before it."""
    combined = getattr(worker.model_runner, STATE, None)
    return len(combined.suffix.cached()) if combined and combined.suffix else None


def register() -> None:
    """vLLM's plugin entry point: wrap the model runner's drafting step and DFlash's greedy draft sampling, for the
    vLLM this plugin knows; otherwise nothing (and one line, where the combined speculator was asked for)."""
    import vllm

    setting = os.environ.get(COMBINED_SETTING)
    if setting:
        parse_combined(setting)  # a bad setting stops the engine's start, not its first request: one line naming it
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
        k = self.drafter.num_speculative_tokens
        looked = combined.look(contexts, k)
        suffixed = combined.suffix_drafts(req_ids, [batch.token_ids_cpu[i, :batch.num_prompt_tokens[i]]
                                                    for i in range(n)], new_tokens, contexts, k, self.max_model_len)
        skip = self.drafter._dflash_train_skip = combined.skips_drafter(looked, suffixed)
        drafts = propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                         sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                         slot_mappings)
        first_p = None if skip else self.drafter._dflash_train_first_p[:n]
        return combined.choose(drafts[:n].tolist(), first_p, looked, suffixed, req_ids)

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
        rule = parse_combined(setting)
        why_not = _why_off(runner, rule)
        if why_not:
            log.warning("dflash-train combined speculator off: %s (%s=%s ignored)", why_not, COMBINED_SETTING,
                        setting)
        else:
            combined = Combined(rule, SuffixSource(SuffixSettings.of(runner.speculative_config))
                                if rule.suffix is not None else None)
            log.info("dflash-train combined speculator on: %s", combined.rule.setting())
    setattr(runner, STATE, combined)
    if combined is not None:
        setattr(runner.drafter, STATE, combined)  # DFlash's sampling records its first drafts' probabilities
    return combined


def _why_off(runner, rule: CombinedRule) -> str | None:
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
    if rule.suffix is not None:
        return suffix_problem()
    return None
