"""What a refresh round decides from what it measured: whether the traffic moved (`drift`: the serving drafter's tau on
the round's new held-out requests against the tau its card states) and whether the candidate is released
(`decide`: the candidate against the serving drafter, paired by prompt in vLLM, on the new held-out requests and on
each earlier round's).

Every tau here is vLLM's mean over prompts of each prompt's tau (`tau_per_prompt`, the pairing's own measure:
`vllm_sweep.paired_against` divides summed per-prompt taus), with its 95% bootstrap interval over prompts.

    drift   moved down  the new traffic's interval lies wholly below the card's tau: the drafter accepts less here
            moved up    wholly above it
            held        the card's tau inside the interval
            unknown     the card states no tau in vLLM (or the eval timed no prompt)
    decide  released    better on the new traffic by its interval (the tau ratio's interval above 1), not worse on any
                        earlier round's traffic beyond the tolerance (its tau ratio at least 1 - tolerance), and
                        losslessness for push's gate to judge (it refuses a drafter whose outputs differ)
            kept        otherwise, each reason said
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_train.eval_report import EvalReport, Interval, Paired, VllmEval

TOLERANCE = 0.05  # the earlier traffic may lose at most 5% of its tau to the new


def _fmt(x: float | None, digits: int = 3) -> str:
    return "?" if x is None else f"{x:.{digits}f}"


def _interval(iv: Interval | None) -> str:
    return "" if not iv else f" [{_fmt(iv[0])}, {_fmt(iv[1])}]"


@dataclass(frozen=True)
class Drift:
    """The serving drafter on the round's new held-out requests against its card, at the card's K (capped at the
    drafter's block), by constraint kind where the round's traffic has several."""
    verdict: str  # moved down | moved up | held | unknown
    k: int
    prompts: int
    tau: float | None
    tau_interval: Interval | None
    card_tau: float | None
    card_tau_interval: Interval | None
    card_k: int | None
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> {"prompts", "tau"}

    def line(self) -> str:
        card = (f"its card's {_fmt(self.card_tau)}{_interval(self.card_tau_interval)} at K = {self.card_k}"
                if self.card_tau is not None else "its card states no tau in vLLM")
        kinds = ("; by kind: " + ", ".join(f"{kind} {_fmt(v['tau'])} ({v['prompts']})"
                                          for kind, v in self.by_kind.items())) if len(self.by_kind) > 1 else ""
        return (f"drift: {self.verdict}: the serving drafter's tau on {self.prompts} new held-out request(s) "
                f"{_fmt(self.tau)}{_interval(self.tau_interval)} at K = {self.k}, {card}{kinds}")

    def record(self) -> dict[str, Any]:
        return asdict(self)


def drift(card: EvalReport | None, measured: VllmEval, kinds: dict[str, str]) -> Drift:
    """The drift verdict of `measured` (the serving drafter's eval on the new held-out requests) against `card`
    (its published eval summary, None where it has none); `kinds`: prompt id -> constraint kind."""
    card_engine = card.vllm if card else None
    card_tau = card_engine.tau_per_prompt if card_engine else None
    tau, iv = measured.tau_per_prompt, measured.tau_per_prompt_interval
    if card_tau is None or tau is None or not iv:
        verdict = "unknown"
    elif iv[1] < card_tau:
        verdict = "moved down"
    elif iv[0] > card_tau:
        verdict = "moved up"
    else:
        verdict = "held"
    grouped: dict[str, list[float]] = {}
    for p in measured.per_prompt:
        if p.tau is not None:
            grouped.setdefault(kinds.get(p.id, "none"), []).append(p.tau)
    by_kind = {kind: {"prompts": len(taus), "tau": sum(taus) / len(taus)} for kind, taus in sorted(grouped.items())}
    return Drift(verdict=verdict, k=measured.best_k or 0, prompts=sum(v["prompts"] for v in by_kind.values()),
                 tau=tau, tau_interval=iv, card_tau=card_tau,
                 card_tau_interval=card_engine.tau_per_prompt_interval if card_engine else None,
                 card_k=card_engine.best_k if card_engine else None, by_kind=by_kind)


@dataclass(frozen=True)
class Comparison:
    """The candidate against the serving drafter on one set of held-out requests (the round's new ones, or an
    earlier round's), side by side in one vLLM eval at one K, paired by prompt."""
    traffic: str  # "new", or the earlier round's name
    k: int
    prompts: int
    tau_candidate: float | None
    tau_serving: float | None
    tau_ratio: float | None
    tau_ratio_interval: Interval | None
    speedup_ratio: float | None
    speedup_ratio_interval: Interval | None

    def line(self) -> str:
        return (f"{self.traffic} traffic, {self.prompts} request(s) at K = {self.k}: tau {_fmt(self.tau_candidate)} "
                f"against the serving drafter's {_fmt(self.tau_serving)}, x{_fmt(self.tau_ratio)}"
                f"{_interval(self.tau_ratio_interval)}; speed x{_fmt(self.speedup_ratio)}"
                f"{_interval(self.speedup_ratio_interval)}")

    def record(self) -> dict[str, Any]:
        return asdict(self)


def comparison(traffic: str, engine: VllmEval) -> Comparison:
    """The candidate (the eval's drafter) against the serving drafter (its baseline drafter) as one eval measured
    them: the pairing is the eval's (`VllmEval.against_baseline`)."""
    paired: Paired | None = engine.against_baseline
    if paired is None:
        raise ValueError("the eval timed no baseline drafter beside the drafter")
    return Comparison(traffic=traffic, k=paired.k, prompts=paired.prompts,
                      tau_candidate=paired.tau, tau_serving=paired.tau_other,
                      tau_ratio=paired.tau_ratio, tau_ratio_interval=paired.tau_ratio_interval,
                      speedup_ratio=paired.speedup_ratio, speedup_ratio_interval=paired.speedup_ratio_interval)


@dataclass(frozen=True)
class Decision:
    release: bool
    reasons: list[str]

    def line(self) -> str:
        return ("release: the candidate is released: " if self.release else
                "release: the serving drafter stays: ") + "; ".join(self.reasons)


def decide(new: Comparison, earlier: list[Comparison], tolerance: float = TOLERANCE) -> Decision:
    """Release the candidate where it is better on the new traffic by its interval and not worse on any earlier
    round's beyond `tolerance`; the reasons either way, one per rule."""
    reasons, ok = [], True
    iv = new.tau_ratio_interval
    if iv and iv[0] > 1:
        reasons.append(f"new traffic: tau x{_fmt(new.tau_ratio)}{_interval(iv)}, above 1")
    else:
        ok = False
        reasons.append(f"new traffic: tau x{_fmt(new.tau_ratio)}{_interval(iv)}: not better by its interval")
    for c in earlier:
        if c.tau_ratio is not None and c.tau_ratio >= 1 - tolerance:
            reasons.append(f"{c.traffic} traffic: tau x{_fmt(c.tau_ratio)}, within {tolerance:.0%}")
        else:
            ok = False
            reasons.append(f"{c.traffic} traffic: tau x{_fmt(c.tau_ratio)}{_interval(c.tau_ratio_interval)}: worse "
                           f"than the serving drafter by more than {tolerance:.0%}")
    return Decision(release=ok, reasons=reasons)
