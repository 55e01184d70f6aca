"""Suffix decoding (vLLM's `suffix` speculator: arctic-inference's suffix tree) as a source of drafts: the tree over
the request's own prompt and answer so far and over the answers the engine gave before, fed exactly as vLLM's
`SuffixDecodingProposer` feeds it (`SuffixSource.step`). No model, no training: it accepts where an answer repeats
earlier answers (a structured application's keys, enums and phrasings), which prompt lookup, reading the current
request only, cannot see.

The combined speculator's plugin (`spec_decode.combined`) drafts with it beside the drafter and prompt lookup, and the
offline probe (probes/combined_rule.py) replays held-out answers through it in request order; both through
`SuffixSource`, so the tree is fed one way. Its global cache holds only the answers fed to it in that run: in the
engine, the ones the engine produced itself."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# vLLM's suffix decoding (`suffix`: SuffixDecoding, no model): drafts from a suffix tree over the request's prompt and
# the answers this engine gave earlier; its tree is arctic-inference's C++ extension (`make install` builds it).
SUFFIX_PACKAGE, SUFFIX_PIN = "arctic_inference", "arctic-inference==0.3.0"


def suffix_problem() -> str | None:
    """Why vLLM's suffix decoding cannot run here, or None."""
    if importlib.util.find_spec(SUFFIX_PACKAGE) is None:
        return (f"vLLM's suffix decoding needs {SUFFIX_PIN} (a C++ suffix tree built from source: `make install` "
                f"builds it, cmake and a C++ compiler needed)")
    try:  # the tree itself, a C++ extension: a broken build is found here, not after minutes of decoding
        importlib.import_module(f"{SUFFIX_PACKAGE}.suffix_decoding")
    except Exception as e:  # noqa: BLE001 - whatever a broken extension raises on import
        return f"{SUFFIX_PIN} is installed but its suffix tree does not load ({type(e).__name__}: {e})"
    return None


@dataclass(frozen=True)
class SuffixSettings:
    """The suffix tree's settings, with vLLM's names less the `suffix_decoding_` prefix and its defaults (vLLM's
    `SpeculativeConfig`): the tree's depth (the longest context match), how many earlier answers its global cache
    keeps (FIFO eviction; 0: none), the draft's length at most `max_spec_factor` x the match's length, and the
    least estimated probability of a drafted token."""
    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    @classmethod
    def of(cls, speculative_config) -> SuffixSettings:
        """The settings of a vLLM `SpeculativeConfig` (its suffix_decoding_* fields exist for every method)."""
        return cls(**{name: getattr(speculative_config, f"suffix_decoding_{name}", default)
                      for name, default in cls().__dict__.items()})


@dataclass(frozen=True)
class SuffixDraft:
    """One request's draft at one step: its tokens, the tree's own score (the sum of the drafted tokens' estimated
    probabilities: the tokens it expects accepted) and the length of the context it matched."""
    token_ids: list[int]
    score: float
    match_len: int


NO_DRAFT = SuffixDraft([], 0.0, 0)


class SuffixSource:
    """One engine's suffix tree, fed as vLLM's suffix proposer feeds it (vLLM 0.32 `SuffixDecodingProposer.propose`):
    a request seen for the first time starts with its prompt (an earlier answer under the same id is evicted first),
    each step appends the tokens it committed, the draft follows the last `max_tree_depth` tokens of the context,
    and a request no longer in the batch is stopped (its answer stays in the global cache, for the requests after
    it)."""

    def __init__(self, settings: SuffixSettings = SuffixSettings()):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.settings = settings
        self.cache = SuffixDecodingCache(max_tree_depth=settings.max_tree_depth,
                                         max_cached_requests=settings.max_cached_requests)

    def draft(self, req_id: str, prompt: np.ndarray | Sequence[int], new_tokens: Sequence[int],
              context: np.ndarray | Sequence[int], k: int, max_model_len: int | None = None) -> SuffixDraft:
        """Request `req_id`'s draft of at most k tokens, after feeding the tokens this step committed
        (`new_tokens`, the last of `context`, its whole token sequence so far; `prompt`: its prompt, read only the
        first time the request is seen). No new tokens (a partial prefill) or no room left: no draft, nothing fed."""
        num_tokens = len(context)
        if not len(new_tokens) or (max_model_len is not None and num_tokens >= max_model_len):
            return NO_DRAFT
        cache = self.cache
        if req_id not in cache.active_requests:
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            cache.start_request(req_id, _int32(prompt))
        cache.add_active_response(req_id, _int32(new_tokens))
        room = k if max_model_len is None else min(k, max_model_len - num_tokens - 1)
        if room < 1:
            return NO_DRAFT
        draft = cache.speculate(req_id, _int32(context[max(0, num_tokens - self.settings.max_tree_depth):]),
                                max_spec_tokens=room, max_spec_factor=self.settings.max_spec_factor,
                                min_token_prob=self.settings.min_token_prob)
        return SuffixDraft(list(draft.token_ids), float(draft.score), int(draft.match_len))

    def finish_others(self, req_ids: Sequence[str]) -> None:
        """Stop the active requests not among `req_ids` (the step's batch): their answers stay cached."""
        for req_id in set(self.cache.active_requests) - set(req_ids):
            self.cache.stop_request(req_id)

    def cached(self) -> set[str]:
        """The request ids whose answers the global cache holds."""
        return set(self.cache.cached_requests)


def _int32(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """Token ids as the contiguous int32 array the tree's zero-copy overloads take."""
    return np.ascontiguousarray(tokens, dtype=np.int32)


def replay_answer(source: SuffixSource, req_id: str, ids: Sequence[int], anchors: Sequence[int], k: int
                  ) -> list[SuffixDraft]:
    """Offline: the drafts an engine's tree gives request `req_id` at each anchor (in order) of its token sequence
    `ids`, whose prompt ends before the first anchor: at anchor a the context is ids[:a + 1] and the step fed
    ids[last anchor + 1 : a + 1] (the first step: the first answer token, as the engine's first decoding step feeds
    the token its prefill sampled). The answer is then finished (it stays cached for the requests replayed after
    it). Appending a sequence's tokens in one call or in several builds the same tree, so every anchor's draft is
    the one any walk through the answer would see there."""
    if not anchors:
        return []
    drafts, fed = [], anchors[0]
    for a in anchors:
        drafts.append(source.draft(req_id, ids[:anchors[0]], ids[fed:a + 1], ids[:a + 1], k))
        fed = a + 1
    if fed < len(ids):  # the rest of the answer, as the engine appends the tokens of its last steps
        source.draft(req_id, ids[:anchors[0]], ids[fed:], ids, 1)
    source.finish_others([])
    return drafts
