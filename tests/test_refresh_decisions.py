"""dflash_train/refresh/decisions.py: whether a round's traffic moved (the serving drafter's tau against its card's)
and whether its candidate is released (paired against the serving drafter on the new and the earlier traffic)."""

import pytest

from dflash_train.eval_report import EvalReport, TimedPrompt, VllmEval
from dflash_train.refresh.decisions import Comparison, decide, drift


def measured(taus, interval, k=4):
    return VllmEval(best_k=k, tau_per_prompt=sum(taus) / len(taus), tau_per_prompt_interval=interval,
                    per_prompt=[TimedPrompt(id=f"p{i}", tau=t) for i, t in enumerate(taus)])


def card(tau, k=4):
    return EvalReport(vllm=VllmEval(best_k=k, tau_per_prompt=tau, tau_per_prompt_interval=[tau - 0.1, tau + 0.1]))


@pytest.mark.parametrize("card_tau, verdict", [(2.5, "moved down"), (1.9, "held"), (1.5, "moved up")])
def test_the_traffic_moved_where_the_new_interval_lies_wholly_on_one_side_of_the_cards_tau(card_tau, verdict):
    found = drift(card(card_tau), measured([1.8, 2.0, 2.0], [1.7, 2.1]), {})
    assert found.verdict == verdict and found.card_tau == card_tau and found.k == 4 and found.prompts == 3
    assert found.line().startswith(f"drift: {verdict}: the serving drafter's tau on 3 new held-out request(s) 1.933")


def test_a_serving_drafter_whose_card_states_no_tau_has_an_unknown_drift_and_its_kinds_are_still_told():
    kinds = {"p0": "json_schema", "p1": "json_schema", "p2": "none"}
    found = drift(None, measured([2.0, 3.0, 1.0], [1.2, 2.8]), kinds)
    assert found.verdict == "unknown" and "its card states no tau in vLLM" in found.line()
    assert found.by_kind == {"json_schema": {"prompts": 2, "tau": 2.5}, "none": {"prompts": 1, "tau": 1.0}}


def compared(traffic, ratio, interval):
    return Comparison(traffic=traffic, k=4, prompts=20, tau_candidate=2.0 * ratio, tau_serving=2.0, tau_ratio=ratio,
                      tau_ratio_interval=interval, speedup_ratio=None, speedup_ratio_interval=None)


def test_a_candidate_better_on_the_new_traffic_by_its_interval_and_within_tolerance_on_the_earlier_is_released():
    decision = decide(compared("new", 1.3, [1.15, 1.45]), [compared("round-001", 0.96, [0.9, 1.02])], 0.05)
    assert decision.release and len(decision.reasons) == 2
    assert decision.line().startswith("release: the candidate is released: new traffic: tau x1.300 [1.150, 1.450]")


@pytest.mark.parametrize("new, earlier, why", [
    ((1.05, [0.98, 1.12]), [], "new traffic: tau x1.050 [0.980, 1.120]: not better by its interval"),
    ((1.0, [1.0, 1.0]), [], "not better by its interval"),  # the serving drafter itself: no better
    ((1.3, [1.15, 1.45]), [(0.94, [0.9, 0.99])], "round-001 traffic: tau x0.940 [0.900, 0.990]: worse than the "
                                                 "serving drafter by more than 5%"),
])
def test_a_candidate_not_better_on_the_new_traffic_or_worse_on_the_earlier_is_not_released(new, earlier, why):
    decision = decide(compared("new", *new), [compared("round-001", *e) for e in earlier], 0.05)
    assert not decision.release and any(why in reason for reason in decision.reasons)
    assert decision.line().startswith("release: the serving drafter stays: ")
