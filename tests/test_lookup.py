import numpy as np

from dflash_train.spec_decode.lookup import lookup_draft, lookup_match


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert lookup_match([1, 2, 3, 1, 2, 3, 1, 2], 4) == ([3, 1, 2], 3)  # suffix 3 1 2; runs to the context's end
    assert lookup_match([5, 1, 6, 1, 7, 1], 2) == ([7, 1], 1)  # suffix [1]: its latest earlier occurrence
    assert lookup_match([9, 4, 5, 8, 4, 5, 6, 4, 5], 2) == ([6, 4], 2)  # 2 tokens matched, the latest of two
    assert lookup_match([1, 2, 3], 4) == ([], 0)  # nothing repeats: no draft
    assert lookup_match([], 4) == ([], 0)


def test_prompt_lookup_reads_lists_and_arrays_alike():
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4]
    assert lookup_match(np.array(context, dtype=np.int32), 3) == lookup_match(context, 3) == ([1, 5, 9], 3)
    assert lookup_draft(context, 2) == [1, 5]


def test_the_combined_rule_takes_lookup_where_it_matched_and_the_drafter_is_unsure():
    from dflash_train.spec_decode.lookup import CombinedRule

    rule = CombinedRule(k=4, confidence=0.6)
    assert rule.picks_lookup(matched=2, first_p=0.3) and rule.picks_lookup(matched=1, first_p=0.59)
    assert not rule.picks_lookup(matched=3, first_p=0.6)  # the drafter is sure enough: its block
    assert not rule.picks_lookup(matched=0, first_p=0.01)  # lookup found nothing: the drafter's block
    everywhere = CombinedRule(k=4, confidence=1)  # wherever lookup matched, the drafter not asked
    assert everywhere.picks_lookup(matched=1, first_p=None) and not everywhere.picks_lookup(matched=0, first_p=None)


def test_the_rule_asks_the_drafter_where_it_out_drafts_lookup_and_takes_lookup_wherever_it_matched_elsewhere():
    from dflash_train.spec_decode.lookup import CombinedRule

    assert CombinedRule.for_taus(drafter_tau=2.2, lookup_tau=1.7) == CombinedRule(k=4, confidence=0.6)
    assert CombinedRule.for_taus(drafter_tau=1.3, lookup_tau=1.5, k=3) == CombinedRule(k=3, confidence=1)


def test_the_combined_setting_reads_back_as_written_and_bad_ones_are_one_line():
    import pytest

    from dflash_train.spec_decode.lookup import CombinedRule, combined_problem, parse_combined

    assert parse_combined(CombinedRule(k=3, confidence=0.7).setting()) == CombinedRule(k=3, confidence=0.7)
    assert parse_combined("on") == parse_combined("k=4") == CombinedRule()
    assert parse_combined(" confidence = 0.5 ") == CombinedRule(confidence=0.5)
    for bad, why in (("k=x", "got 'k=x'"), ("depth=3", "got 'depth=3'"), ("k=0", "k must be at least 1"),
                     ("confidence=1.5", "within [0, 1]")):
        with pytest.raises(ValueError, match="DFLASH_TRAIN_LOOKUP="):
            parse_combined(bad)
        assert why in combined_problem(bad) and "\n" not in combined_problem(bad)
    assert combined_problem(None) is None and combined_problem("on") is None
