"""What the demo's plan and the benchmarks measure and decide on this machine (dflash_train/support/measure.py): the
choice between storing the target's states and computing them online."""

from __future__ import annotations

import pytest

from dflash_train.support import measure

RATES = {"capture_states_tok_s": 100.0, "capture_tokens_tok_s": 200.0, "train_stored_tok_s": 800.0,
         "train_online_tok_s": 400.0, "state_bytes_per_token": 5760.0}


def test_break_even_epochs_weigh_the_capture_once_against_every_epoch():
    # states cost 1/100 - 1/200 = 5 ms per token once; online costs 1/400 - 1/800 = 1.25 ms per token and epoch
    assert measure.break_even_epochs(RATES) == pytest.approx(4.0)
    assert measure.break_even_epochs({**RATES, "train_online_tok_s": 800.0}) == float("inf")
    assert measure.break_even_epochs({**RATES, "capture_tokens_tok_s": 90.0}) == 0.0


def test_choose_hidden_states_stores_from_the_break_even_on_unless_the_disk_is_too_small():
    assert measure.choose_hidden_states(RATES, 6)[0] == "stored"
    assert measure.choose_hidden_states(RATES, 4)[0] == "stored"  # a tie: nothing to gain by recomputing
    choice, reason = measure.choose_hidden_states(RATES, 3)
    assert choice == "online" and "break-even 4.00" in reason
    assert measure.choose_hidden_states({**RATES, "train_online_tok_s": 900.0}, 100)[0] == "online"
    fits = measure.choose_hidden_states(RATES, 6, tokens=10**6, disk_free_bytes=10 * 2**30)
    assert fits[0] == "stored"  # 5.4 GiB of states, 10 GiB free
    choice, reason = measure.choose_hidden_states(RATES, 6, tokens=10**6, disk_free_bytes=6 * 2**30)
    assert choice == "online" and "5.4 GiB" in reason and "80% of the 6.0 GiB free" in reason
