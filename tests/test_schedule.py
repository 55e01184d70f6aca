"""Where a run stands (dflash_train/stages/train/schedule.py): the learning-rate factor, the training clock against
its time budget, and the context warm-up."""

import pytest

from dflash_train.stages.train.schedule import TrainClock, in_context_warmup, lr_factor


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, 100, 0.04, "cosine", 0.0) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[-1] < 0.01
    assert lr_factor(50, 100, 0.04, "constant", 0.0) == 1.0
    assert lr_factor(99, 100, 0.0, "cosine", 0.1) >= 0.1


def test_lr_schedule_wsd_and_time_budget_progress():
    f = [lr_factor(s, 100, 0.1, "wsd", 0.0, decay_ratio=0.2) for s in range(100)]
    assert f[9] == 1.0 and all(x == 1.0 for x in f[10:80])  # warmup, then stable
    assert all(a > b for a, b in zip(f[80:], f[81:])) and f[-1] < 0.1  # linear decay over the last 20%
    # with a time budget the same shape runs on the fraction of the budget used, whatever the step
    assert lr_factor(3, 10_000, 0.1, "wsd", 0.0, decay_ratio=0.2, progress=0.05) == pytest.approx(0.5)
    assert lr_factor(3, 10_000, 0.1, "wsd", 0.0, decay_ratio=0.2, progress=0.5) == 1.0
    assert lr_factor(3, 10_000, 0.1, "wsd", 0.1, decay_ratio=0.2, progress=0.9) == pytest.approx(0.55)
    assert lr_factor(3, 10_000, 0.0, "cosine", 0.0, progress=1.0) == pytest.approx(0.0)
    clock = TrainClock(budget_s=10.0, already_s=4.0)
    assert clock.progress_at(3, 10_000) == pytest.approx(0.4) and not clock.expired
    # a run that reaches its max_steps before its budget is that far along: the schedule decays on steps then
    assert clock.progress_at(90, 100) == pytest.approx(0.9)
    clock.spent_s = 10.0
    assert clock.expired and TrainClock(None).progress_at(5, 10) is None


def test_context_warmup_covers_the_first_fraction_of_steps_or_of_the_time_budget():
    from dflash_train.stages.train.recipe import Recipe

    recipe = Recipe()
    recipe.objective.context_warmup_ratio = 0.4
    no_budget = TrainClock(None)
    assert in_context_warmup(recipe, 39, 100, no_budget) and not in_context_warmup(recipe, 40, 100, no_budget)
    assert in_context_warmup(recipe, 500, 10_000, TrainClock(100.0, already_s=39.0))
    assert not in_context_warmup(recipe, 5, 10_000, TrainClock(100.0, already_s=41.0))
    recipe.objective.context_warmup_ratio = 0.0
    assert not in_context_warmup(recipe, 0, 100, no_budget)
