"""Prompt lookup, vLLM's `ngram` speculator, as one rule: the draft is the tokens that followed the latest earlier
occurrence of the context's last n tokens, n from PROMPT_LOOKUP's max down to its min (prompt and answer so far).
No model, no training: it accepts where the answer repeats its context (loops, quotes, fixed keys, copied code).
The eval times vLLM's own; the probes and the combined speculator (`spec_decode.combined`) draft with this one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PROMPT_LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}  # vLLM's names; the project's setting
LOOKUP_N = tuple(range(PROMPT_LOOKUP["prompt_lookup_max"], PROMPT_LOOKUP["prompt_lookup_min"] - 1, -1))


def lookup_match(context: Sequence[int] | np.ndarray, k: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's longest matching suffix (n in
    LOOKUP_N), and that n (0: no earlier occurrence, no draft)."""
    tokens = np.asarray(context)
    for n in LOOKUP_N:
        if len(tokens) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # starts 0 .. len - n - 1
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start:start + k].tolist(), n
    return [], 0


def lookup_draft(context: Sequence[int] | np.ndarray, k: int) -> list[int]:
    """lookup_match's draft alone."""
    return lookup_match(context, k)[0]


@dataclass(frozen=True)
class CombinedRule:
    """Which block the combined speculator (`spec_decode.combined`) verifies for a request at a step, from what is known
    before the target verifies. With `suffix` (a score), the suffix tree's block (`suffix.SuffixSource`: this
    engine's earlier answers and the request's own tokens) where its own score, the tokens it expects accepted,
    is at least `suffix`; else prompt lookup's block (at most `k` tokens) where lookup matched and the drafter's
    probability of its first draft is below `confidence`; else the drafter's. At confidence 1 lookup's block is
    taken wherever it matched, whatever the drafter says. A request whose block is decided without the drafter
    (`needs_drafter` False) does not ask it, and a step where no request does skips the drafter's pass. Chosen
    offline on the demos' held-out answers walked as greedy decoding walks, the suffix tree replayed in request
    order (probes/combined_rule.py): 0.6 where the drafter out-drafts lookup, 1 where it does not (`for_taus`);
    suffix SUFFIX_SCORE where the suffix tree can run."""
    k: int = 4
    confidence: float = 0.6
    suffix: float | None = None

    @property
    def asks_drafter(self) -> bool:
        """Whether a step where lookup matched (and the suffix tree's block was not taken) needs the drafter's
        first draft to choose."""
        return self.confidence < 1

    def picks_suffix(self, score: float, length: int) -> bool:
        """Whether the suffix tree's draft of `length` tokens and this `score` is the block to verify."""
        return self.suffix is not None and length > 0 and score >= self.suffix

    def picks_lookup(self, matched: int, first_p: float | None) -> bool:
        """first_p: the drafter's probability of its first draft (None: not asked, `asks_drafter` False)."""
        return matched > 0 and (not self.asks_drafter or first_p < self.confidence)

    def needs_drafter(self, suffix_score: float, suffix_length: int, matched: int) -> bool:
        """Whether a request's block depends on the drafter's pass: not where the suffix tree's block is taken, nor
        where lookup matched and the drafter is not asked there."""
        return not self.picks_suffix(suffix_score, suffix_length) and not (matched > 0 and not self.asks_drafter)

    def source(self, suffix_score: float, suffix_length: int, matched: int, first_p: float | None) -> str:
        """The block to verify: "suffix", "lookup" or "drafter" (first_p None where `needs_drafter` is False)."""
        if self.picks_suffix(suffix_score, suffix_length):
            return "suffix"
        return "lookup" if self.picks_lookup(matched, first_p) else "drafter"

    @classmethod
    def for_taus(cls, drafter_tau: float, lookup_tau: float, k: int = 4, suffix: float | None = None
                 ) -> CombinedRule:
        """The rule for a drafter and prompt lookup measured alone (tau at their own best K): where the drafter
        drafts more, its confidence picks between them; where lookup does, lookup wherever it matched (asking the
        drafter there gains no tau and costs its pass). `suffix`: the suffix tree's score, or None (no tree)."""
        return cls(k=k, confidence=cls().confidence if drafter_tau > lookup_tau else 1.0, suffix=suffix)

    @property
    def name(self) -> str:
        """The combined speculator's name in a ranking: its sources."""
        return "drafter + suffix + prompt lookup" if self.suffix is not None else "drafter + prompt lookup"

    def setting(self) -> str:
        """The rule as COMBINED_SETTING's value: parse_combined(rule.setting()) == rule."""
        return f"k={self.k},confidence={self.confidence:g}" + ("" if self.suffix is None else
                                                               f",suffix={self.suffix:g}")


# The suffix tree's score (the tokens it expects accepted) at or above which its block is verified
# (`CombinedRule.suffix`), chosen offline on the router demo's 20 held-out answers, the tree replayed in request order,
# at this CPU's measured step costs (BENCHMARKS "A combined speculator's rule, offline"): at confidence 0.6 the best
# walked tau (2.58 against suffix decoding's 1.99 and the drafter's 2.21) within 0.4% of the best modelled speed.
SUFFIX_SCORE = 1.5


COMBINED_SETTING = "DFLASH_TRAIN_LOOKUP"  # the environment variable that turns the combined speculator on


def parse_combined(text: str) -> CombinedRule:
    """COMBINED_SETTING's value ("k=4,confidence=0.6,suffix=1", any key may be left out, no suffix: no suffix tree;
    "on": the defaults) as a rule; ValueError, one line naming the setting, on anything else."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "on":
            continue
        key, _, value = part.partition("=")
        try:
            number = {"k": int, "confidence": float, "suffix": float}[key.strip()](value)
        except (KeyError, ValueError):
            raise ValueError(f"{COMBINED_SETTING}={text!r}: expected k=INT,confidence=FLOAT[,suffix=FLOAT] (e.g. "
                             f"{CombinedRule().setting()!r}), got {part!r}") from None
        values[key.strip()] = number
    rule = CombinedRule(**values)
    if rule.k < 1 or not 0 <= rule.confidence <= 1 or not (rule.suffix is None or 0 <= rule.suffix < math.inf):
        raise ValueError(f"{COMBINED_SETTING}={text!r}: k must be at least 1, confidence within [0, 1] and suffix "
                         f"a score of at least 0")
    return rule


def combined_problem(value: str | None) -> str | None:
    """A --combined option's rule (None: not given), or why it is not one."""
    try:
        value is None or parse_combined(value)
    except ValueError as e:
        return str(e).split(": ", 1)[-1]
    return None
