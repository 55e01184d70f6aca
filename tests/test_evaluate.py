"""The eval stage: metric definitions, offline vs online acceptance, the report, and refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from tiny import TOOL_CALL_REQUEST

from dflash_train import eval_report
from dflash_train.eval_report import SCHEMA_VERSION, ConcurrencyRow, FirstK, KRow, Machine, SourceCount
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.spec_decode.lookup import SUFFIX_SCORE
from dflash_train.spec_decode.loop import DFlashProposer, Step, speculative_generate
from dflash_train.spec_decode.suffix import suffix_problem
from dflash_train.stages.evaluate.metrics import acceptance_stats, offline_estimate
from test_spec_decode import PROMPTS, prompt_ids, reference

REPO = Path(__file__).resolve().parent.parent


def test_a_drafter_folder_its_training_did_not_finish_is_refused(tmp_path, capsys):
    """A training killed while it exported the drafter leaves the old files beside the INCOMPLETE marker: eval
    measured them as if they were the run's drafter (push refused the folder)."""
    from dflash_train.cli import main as cli_main

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "INCOMPLETE").write_text("{}")
    assert cli_main(["eval", "--drafter", str(drafter), "--prompts", str(tmp_path), "--out", str(tmp_path / "e")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-train eval: error: drafter folder {drafter} is marked incomplete: its training run did not finish "
        f"writing it (rerun the training command to finish it)"]


def test_tau_and_per_position_on_hand_made_step_logs():
    logs = [
        [Step(accepted=3, committed=4), Step(accepted=0, committed=1), Step(accepted=1, committed=2)],  # 4, 1, 2
        [Step(accepted=3, committed=2)],  # a stop token after 2 tokens: still 1 + 3 = 4, as the reference counts
        [],  # ended on the prefill token: no step, not counted
    ]
    stats = acceptance_stats(logs, block_size=4)
    assert stats.tau_steps == pytest.approx((4 + 1 + 2 + 4) / 4)  # the headline: every step alike
    assert stats.tau_per_prompt == pytest.approx(((4 + 1 + 2) / 3 + 4) / 2)  # each prompt alike
    assert stats.per_position_acceptance == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert stats.tau_histogram == {"1": 1, "2": 1, "3": 0, "4": 2}
    assert stats.num_steps == 4
    assert stats.tau_steps == pytest.approx(1 + sum(stats.per_position_acceptance))
    assert math.isnan(acceptance_stats([[]], 4).tau_per_prompt)
    # intervals over prompts: tau_steps' a ratio of sums (a prompt weighs by its steps)
    lo, hi = acceptance_stats(logs * 3, block_size=4).tau_steps_interval
    assert lo <= (4 + 1 + 2 + 4) / 4 <= hi


def test_bootstrap_interval_is_seeded_and_holds_the_whole_sample_figure():
    from dflash_train.stages.evaluate.metrics import bootstrap_interval, mean_of, ratio_of_sums

    taus = [1.0, 2.0, 4.0, 1.5, 3.0]
    lo, hi = bootstrap_interval(mean_of(taus), len(taus))
    assert 1.0 <= lo < sum(taus) / len(taus) < hi <= 4.0
    assert bootstrap_interval(mean_of(taus), len(taus)) == [lo, hi]  # seeded: the same report twice
    assert bootstrap_interval(ratio_of_sums([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]), 3) == [2.0, 2.0]  # no spread, none
    assert bootstrap_interval(mean_of([2.0]), 1) is None  # one prompt: no interval
    assert mean_of([None, None, 2.0])([0, 1]) is None  # prompts without a verification step do not count


def test_k_sweep_order_spans_the_block_before_filling_it_in():
    """A sweep cut short by its budget has still timed the whole block, K = 1 and the middle."""
    from dflash_train.stages.evaluate.vllm_sweep import k_sweep_order

    order = k_sweep_order(15)
    assert sorted(order) == list(range(1, 16)) and order[:4] == [15, 1, 4, 2]
    assert k_sweep_order(1) == [1] and k_sweep_order(2) == [2, 1] and sorted(k_sweep_order(7)) == list(range(1, 8))


def test_the_sweep_times_first_the_shortest_k_that_keeps_the_whole_blocks_tau():
    """Longer K cost no less to verify, so past the K whose expected tau is within 1% of the whole block's no K can
    be more than 1% faster: that K runs first, then the range below it, then the longer ones."""
    from dflash_train.stages.evaluate.vllm_sweep import k_sweep_order, sweep_first_k, tau_by_k_of

    weak = tau_by_k_of([0.27, 0.05, 0.005] + [0.0] * 12)  # the rewrite demo's drafter: nothing past position 3
    assert weak[:3] == pytest.approx([1.27, 1.32, 1.325])
    assert sweep_first_k(weak) == 2  # tau 1.32 of 1.325: K = 3 would add 0.4%
    assert sweep_first_k(tau_by_k_of([0.27, 0.05, 0.02] + [0.0] * 12)) == 3  # 1.5% more at K = 3: keep it
    assert sweep_first_k(tau_by_k_of([0.9] * 15)) == 15 and sweep_first_k(tau_by_k_of([0.0] * 15)) == 1
    triage = [1.485, 1.75, 1.85, 1.901, 1.95, 1.97, 1.99, 1.999, 2.003, 2.005, 2.006, 2.007, 2.01, 2.012, 2.015]
    assert sweep_first_k(triage) == 8  # the triage log's walked estimate: K = 8 within 1% of the best
    assert sweep_first_k(None) is None and sweep_first_k([1.3, math.nan]) is None  # no estimate: the old order
    # with what a step costs at each K, the best expected speed: the triage demo's drafter (its walked estimate),
    # whose step cost 1.40 plain steps at K = 1 and 1.87 at 15 under its schema, was fastest at K = 4 (1.24-1.26x)
    demo = [1.49, 1.72, 1.84, 1.93, 1.97, 2.01, 2.02, 2.02, 2.06, 2.07, 2.07, 2.07, 2.07, 2.07, 2.07]
    assert sweep_first_k(demo) == 9 and sweep_first_k(demo, [1.37, 0.034]) == 4
    assert sweep_first_k(demo, [1.37, 0.02]) == 5 and sweep_first_k(demo, [2.0, 0.0]) == 9  # a flat cost: tau's K
    order = k_sweep_order(15, 2)
    assert sorted(order) == list(range(1, 16)) and order[:4] == [2, 1, 15, 5]
    assert k_sweep_order(15, 15) == k_sweep_order(15) and k_sweep_order(7, 3)[:3] == [3, 1, 2]


def test_where_speculation_stops_paying_and_vllms_per_batch_size_k():
    from dflash_train.stages.evaluate.vllm_sweep import best_per_concurrency, pays_up_to, per_batch_size_schedule

    rows = [ConcurrencyRow(requests=c, k=k, speedup=x) for c, k, x in ((1, 3, 1.4), (1, 1, 1.2), (4, 3, 0.9),
                                                                        (4, 1, 1.1), (16, 3, 0.6), (16, 1, 0.8))]
    best = best_per_concurrency(rows)
    assert [(r.requests, r.k) for r in best] == [(1, 3), (4, 1), (16, 1)]
    assert pays_up_to(best) == 4
    # each range runs the K fastest at the concurrency it holds, split between measured ones; 0 = no drafts
    assert per_batch_size_schedule(best) == [[1, 2, 3], [3, 8, 1], [9, 16, 0]]
    one_k = [dataclasses.replace(r, k=3) for r in best[:2]]
    assert per_batch_size_schedule(one_k) is None  # one K serves all: num_speculative_tokens says it
    losing = [dataclasses.replace(r, speedup=0.9) for r in best]
    assert pays_up_to(losing) == 0 and per_batch_size_schedule(losing) is None


def fake_engine(calls: list, natural: dict[str, list[int]], spec_s: dict[int, float], together_s: dict[int, float],
                skipped: list[int], plain_s: dict[int, float] | None = None, refuses=None):
    """A stand-in for runner.run_engine that answers a timed job the way the child does (child._timed): plain
    outputs to the natural stop (decode phase 0.8 s), and per K the timings (plain 1 s per prompt, or plain_s[K],
    and 2 s per batch, speculative spec_s[K] and together_s[K]; the decode phase 0.2 s less, the stopwatch 0.1 s
    more, on both sides) and the speculative outputs (K=3: the first prompt differs from plain in bf16). Each free
    speculator (method, K) of the job's `free` is timed the same way, its timings under the key (method, K), else
    the method. `refuses(job)`: the requests the engine refuses (id -> why), left out of every output as the child
    leaves them."""
    from dflash_train.engine.jobs import EngineOutput, EngineResult

    def run_engine(job, workdir, what):
        calls.append(job)
        asked = refuses(job) if refuses else {}
        refused = {r.id: asked[r.id] for r in job.requests if r.id in asked}
        ids = [r.id for r in job.requests if r.id not in refused]
        runs = []
        todo = [("dflash", k, k) for k in job.speculative_tokens if k not in skipped]
        todo += [(method, k, (method, k) if (method, k) in spec_s else method) for method, k in job.free]
        for method, k, key in todo:
            outputs = []
            for i, rid in enumerate(ids):
                tokens = list(natural[rid])
                if key == 3 and i == 0 and job.dtype != "float32":
                    tokens[-1] += 1
                accepted = [k] * ((len(tokens) - 1) // (k + 1))  # every draft accepted: tau = 1 + k
                outputs.append({"id": rid, "token_ids": tokens, "finish_reason": "length", "decode_s": spec_s[key],
                                "accepted": accepted, "drafted": [k] * len(accepted)})
            def times(n: int, tokens: int, plain: float, spec: float) -> dict:
                return {"requests": n, "tokens": tokens, "plain_core_s": [plain], "spec_core_s": [spec],
                        "plain_decode_s": [plain - 0.2], "spec_decode_s": [spec - 0.2],
                        "plain_wall_s": [plain + 0.1], "spec_wall_s": [spec + 0.1]}
            timed = [{"id": rid, **times(1, len(natural[rid]), (plain_s or {}).get(key, 1.0), spec_s[key])}
                     for rid in ids]
            together = [times(c, c * 9, 2.0, together_s[key]) for c in job.concurrency]
            runs.append({"method": method, "k": k, "llm_kwargs": job.llm_kwargs(k, method), "load_s": 30.0,
                         "seconds": 60.0, "outputs": outputs, "batch1": timed, "concurrency": together})
        return EngineResult(version="0.32.0", llm_kwargs=job.llm_kwargs(), load_s=30.0, wall_s=100.0,
                            outputs=[EngineOutput(id=rid, token_ids=natural[rid], finish_reason="stop", decode_s=0.8)
                                     for rid in ids], environment={},
                            timed={"runs": runs, "skipped": [k for k in job.speculative_tokens if k in skipped]},
                            refused=refused)
    return run_engine


def test_the_engine_eval_reports_the_fastest_k_with_its_figures_and_intervals(tiny_target, drafters, monkeypatch,
                                                                              tmp_path):
    """best_k is the fastest K at batch 1; the entry's headline figures (push's gate, the card) are its own; the
    speedups are ratios of the same runs' seconds by both clocks; only best_k's bf16 mismatches are rerun in fp32."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables
    from dflash_train.errors import UserError
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    calls: list = []
    monkeypatch.setattr(runner, "run_engine", fake_engine(calls, natural, {3: 0.5, 1: 0.8, 2: 0.6}, {3: 4.0, 1: 2.2, 2: 3.0},
                                                         skipped=[2]))
    cfg = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1, 3, 2],
                     concurrency=[2], engine_args={"max_num_seqs": 8})
    v = engine_eval(cfg, tiny_target, prompts, 4, "bf16", "cpu", tmp_path)
    job = calls[0]
    assert (job.mode, job.speculative_tokens, job.concurrency, job.budget_s) == ("timed", [1, 3, 2], [2], 900.0)
    assert job.llm_kwargs(3)["max_num_seqs"] == 8  # the user's engine arguments over the job's
    assert [r.k for r in v.sweep] == [1, 3] and v.timing.skipped_k == [2]
    assert v.best_k == 3
    best = next(r for r in v.sweep if r.k == 3)
    assert v.tau_steps == best.tau_steps == v.tau_per_prompt == 4.0 and len(v.per_position_acceptance) == 3
    assert v.speedup == pytest.approx(2.0) and v.speedup_wall == pytest.approx(1.1 / 0.6)
    assert v.speedup_decode == pytest.approx(0.8 / 0.3)
    assert v.tokens_per_s == pytest.approx(9 / 0.5) and v.tokens_per_s_wall == pytest.approx(9 / 0.6)
    assert v.tokens_per_s_decode == pytest.approx(8 / 0.3)  # the tokens after the first, as the own loop counts
    assert v.speedup_interval == pytest.approx([2.0, 2.0]) and v.tau_steps_interval == [4.0, 4.0]
    assert v.best_k_share == 1.0
    assert '"num_speculative_tokens":3' in v.serve_command and "--max-num-seqs 8" in v.serve_command
    # the lossless check is best_k's; its bf16 mismatch is rerun in fp32 (that K only, that prompt only)
    assert (v.lossless_mismatches, v.lossless_mismatches_fp32) == (1, 0) and best.lossless_mismatches == 1
    rerun = calls[1]
    assert (rerun.dtype, rerun.speculative_tokens, [r.id for r in rerun.requests]) == ("float32", [3], ["p0"])
    assert rerun.mode == "check" and v.lossless_recheck_s >= 0  # the lossless check alone, its seconds kept
    assert v.mismatches[0].id == "p0" and v.mismatches[0].fp32_spec_equals_plain is True
    # concurrency: batch 1 from the sweep, 2 from its runs; the 2-request batch is slower with drafts here
    assert [(r.requests, r.k) for r in v.concurrency] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert [(r.requests, r.k) for r in v.concurrency_best] == [(1, 3), (2, 1)]
    assert v.pays_up_to_concurrency == 1 and v.per_batch_size_schedule == [[1, 1, 3], [2, 2, 0]]
    assert v.timing.first_k is None  # the user's K, in the user's order
    assert v.timing.host_drift == pytest.approx(0.0)  # plain decoding as fast in every pass: a steady machine
    assert v.timing.host_unsteady is False
    assert "speed changed" not in "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    # without --speculative-tokens the sweep starts at the K the acceptance estimate keeps tau with, and says so
    calls.clear()
    ordered = engine_eval(EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12,
                                     concurrency=[2]), tiny_target, prompts, 4, "fp32", "cpu", tmp_path,
                          ("offline estimate", [0.5, 0.0, 0.0]))
    assert calls[0].speculative_tokens == [1, 3, 2]
    assert ordered.timing.first_k == FirstK(k=1, source="offline estimate", slack=0.01, step_cost=None)
    first = "\n".join(serving_tables(ordered, Machine(cpu="Some CPU", cores=2, load_average=[0.5, 0.5, 0.5])))
    assert "Timed first: K = 1, the shortest whose expected tau by the offline estimate is within 1% of the best." \
        in first
    calls.clear()  # with --step-cost: the best expected tau over a step's cost, and the report says so
    costed = engine_eval(EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12,
                                    concurrency=[2], step_cost=[1.0, 0.5]), tiny_target, prompts, 4, "fp32", "cpu",
                         tmp_path, ("offline estimate", [1.5, 2.1, 2.2]))
    assert calls[0].speculative_tokens[0] == 2  # 1.5 / 1.5, 2.1 / 2.0, 2.2 / 2.5 (by tau alone: 3)
    assert costed.timing.first_k.step_cost == [1.0, 0.5]
    assert ("Timed first: K = 2, the shortest whose expected speed (tau by the offline estimate over a step's cost "
            "of 1.00 + 0.500 x K plain decoding steps, as measured on this machine) is within 1% of the best.") in \
        "\n".join(serving_tables(costed, Machine(cpu="Some CPU", cores=2, load_average=[0.5, 0.5, 0.5])))
    assert all(row.step_cost > 0 for row in costed.sweep)  # each K's step in plain steps, in the report
    with pytest.raises(UserError, match="--speculative-tokens 4 is more than the verify block holds "
                                        r"\(B - 1 = 3"):
        engine_eval(EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", speculative_tokens=[4]), tiny_target,
                    prompts, 4, "bf16", "cpu", tmp_path)
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2, load_average=[0.5, 0.5, 0.5])))
    assert "best_k = 3: the fastest at batch 1 (in 100% of the bootstrap" in text and "K = 2" in text
    assert "| **3** | 4 [4, 4] | 9 / 18 | 2 [2, 2]× |" in text and "Some CPU (2 cores), bf16" in text
    assert "Speculation pays one request at a time only." in text and "[[1, 1, 3], [2, 2, 0]]" in text


def test_a_sweep_on_a_machine_whose_speed_changed_says_so(tiny_target, drafters, monkeypatch, tmp_path):
    """Plain decoding runs the same prompts at the same lengths in the reference pass and in every K's runs: when
    its own speed moves more than HOST_DRIFT_LIMIT between them, the report says the speedups are not to be
    believed (a demo's 1.10x at tau 1.26 was plain decoding at 12.6 tokens/s in one K's runs and 21.7 in the next)."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    monkeypatch.setattr(runner, "run_engine", fake_engine([], natural, {1: 0.9, 3: 1.2}, {1: 2.0, 3: 2.0}, [],
                                                          plain_s={3: 1.8}))
    v = engine_eval(EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12,
                               speculative_tokens=[3, 1], concurrency=[]), tiny_target, prompts, 4, "fp32", "cpu",
                    tmp_path)
    rates = v.timing.plain_tokens_per_s_decode
    assert rates == pytest.approx({"reference": 10.0, "3": 5.0, "1": 10.0})  # 8 tokens after the first in 0.8 s
    assert v.timing.host_drift == pytest.approx(1.0) and v.timing.host_unsteady is True
    assert v.best_k == 3  # "faster" because plain decoding slowed down in its runs
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    assert ("**The machine's speed changed while it was measured**: plain decoding ran at 5.0 to 10.0 tokens/s "
            "(decode phase) over the reference pass and the K's runs, 100% apart") in text


def test_a_machine_that_slowed_while_prompt_lookup_was_timed_is_flagged_too(tiny_target, drafters, monkeypatch,
                                                                           tmp_path):
    """Prompt lookup is timed after the drafter's K, against plain runs of its own: those join the drift check."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    monkeypatch.setattr(runner, "run_engine", fake_engine([], natural, {1: 0.9, "ngram": 1.5}, {1: 2.0}, [],
                                                          plain_s={"ngram": 1.8}))
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1],
                        concurrency=[])
    steady = engine_eval(config, tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
    assert steady.ngram is None and steady.timing.host_unsteady is False  # the drafter's K alone: steady
    v = engine_eval(dataclasses.replace(config, ngram=[2]), tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
    assert v.ngram.k == 2 and v.ngram.speedup == pytest.approx(1.8 / 1.5)  # against its own plain runs
    rates = v.timing.plain_tokens_per_s_decode
    assert rates == pytest.approx({"reference": 10.0, "1": 10.0, "prompt lookup 2": 5.0})
    assert v.timing.host_drift == pytest.approx(1.0) and v.timing.host_unsteady is True
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    assert ("plain decoding ran at 5.0 to 10.0 tokens/s (decode phase) over the reference pass and the K's runs and "
            "prompt lookup's, 100% apart") in text


def test_where_prompt_lookup_is_faster_than_the_drafter_the_tables_say_how_to_serve_it(tiny_target, drafters,
                                                                                      monkeypatch, tmp_path):
    """The eval measures both; the user serves the faster: its speculative config, ready to paste, only when it wins."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1],
                        concurrency=[], ngram=[4])
    advice = ("Prompt lookup is the fastest here: serve it with `--speculative-config '{\"method\":\"ngram\","
              "\"num_speculative_tokens\":4,\"prompt_lookup_min\":1,\"prompt_lookup_max\":3}'` in place of the "
              "drafter's.")
    for lookup_s, faster in ((0.8, True), (0.95, False)):  # the drafter's K = 1 at 0.9 s against plain's 1 s
        monkeypatch.setattr(runner, "run_engine", fake_engine([], natural, {1: 0.9, "ngram": lookup_s}, {}, []))
        v = engine_eval(config, tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
        text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
        assert (advice in text) is faster, text


def test_suffix_decoding_is_timed_beside_lookup_and_the_fastest_of_the_three_is_the_one_to_serve(
        tiny_target, drafters, monkeypatch, tmp_path):
    """Each free speculator at its own fastest K, every K of lookup and suffix decoding in the drafter's engine job
    (sharing plain decoding's runs); the report ranks drafter, lookup and suffix, and the tables name the winner's
    config."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables, speculator_to_serve
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    calls: list = []
    monkeypatch.setattr(runner, "run_engine", fake_engine(calls, natural, {
        1: 0.9, "ngram": 0.8, ("suffix", 4): 0.75, ("suffix", 8): 0.6}, {}, []))
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1],
                        concurrency=[], ngram=[3], suffix=[4, 8])
    v = engine_eval(config, tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
    assert [c.free for c in calls] == [[("ngram", 3), ("suffix", 4), ("suffix", 8)]]
    assert calls[0].llm_kwargs(4, "suffix")["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 4}
    assert v.suffix.k == 8 and [r.k for r in v.suffix_sweep] == [4, 8]
    assert [(r.speculator, r.k) for r in v.ranking] == [("suffix decoding", 8), ("prompt lookup", 3),
                                                                 ("drafter", 1)]
    assert v.ranking[0].speedup == pytest.approx(1 / 0.6)
    assert speculator_to_serve(v).name == "suffix decoding"
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    assert ("Suffix decoding is the fastest here: serve it with `--speculative-config "
            "'{\"method\":\"suffix\",\"num_speculative_tokens\":8}'`") in text
    assert "| 1 | suffix decoding | 8 |" in text and "8, suffix decoding" in text


def test_the_combined_speculator_is_timed_at_lookups_k_ranked_and_served_with_its_setting(
        tiny_target, drafters, monkeypatch, tmp_path):
    """--combined on: after the drafter's sweep, the combined speculator in an engine job of its own (its rule in
    the job, the drafter's config: the plugin turns it on) at the longer of the drafter's fastest K and the rule's
    k, within the drafter's block; lookup out-drafts the drafter here, so the rule takes lookup wherever it matched;
    its blocks by source summed over the prompts, ranked with the others; where it is the fastest the tables say to
    serve the drafter with its setting."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables, speculator_to_serve
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    calls: list = []
    fake = fake_engine(calls, natural, {1: 0.9, 2: 0.8, "ngram": 0.85, "combined": 0.7}, {}, [])

    def with_sources(job, workdir, what):  # the child's per-request blocks by source (spec_decode.combined)
        result = fake(job, workdir, what)
        for run in result.timed["runs"]:
            for out in run["outputs"] if run["method"] == "combined" else []:
                out["sources"] = {"drafter": {"blocks": 1, "drafted": 2, "accepted": 1},
                                  "lookup": {"blocks": 2, "drafted": 4, "accepted": 3, "without_drafter": 1}}
        return result
    monkeypatch.setattr(runner, "run_engine", with_sources)
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1, 2],
                        concurrency=[], ngram=[3], combined="on")
    v = engine_eval(config, tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
    combined_job = calls[-1]
    # with the suffix tree where arctic-inference loads (no suffix decoding timed here: K stays lookup's)
    setting = "k=4,confidence=1" + ("" if suffix_problem() else f",suffix={SUFFIX_SCORE:g}")
    name = "drafter + prompt lookup" if suffix_problem() else "drafter + suffix + prompt lookup"
    assert (combined_job.free, combined_job.combined) == (
        [("combined", 3)], setting)  # the rule's k 4, cut to the block's 3; the rule spelled out
    assert combined_job.speculative_tokens == [] and combined_job.drafter == str(drafters[0])
    assert combined_job.llm_kwargs(2, "combined")["speculative_config"]["method"] == "dflash"
    c = v.combined
    assert c.k == 3 and c.setting == setting and c.lossless_mismatches == 0
    assert c.sources == {"drafter": SourceCount(blocks=4, drafted=8, accepted=4),
                         "lookup": SourceCount(blocks=8, drafted=16, accepted=12, without_drafter=4)}
    assert [r.speculator for r in v.ranking] == [name, "drafter", "prompt lookup"]
    # paired by prompt against each other at its own fastest K: every prompt 0.7 s (tau 4 at K = 3) against 0.8 s
    # (the drafter at K = 2, tau 3), against 0.85 s (lookup at K = 3, tau 4), plain 1 s on each side
    drafter, lookup = c.against["drafter"], c.against["prompt lookup"]
    assert (drafter.k, drafter.prompts, lookup.k) == (2, 4, 3)
    assert drafter.speedup_ratio == pytest.approx(0.8 / 0.7) and lookup.speedup_ratio == pytest.approx(0.85 / 0.7)
    assert drafter.speedup_ratio_interval == pytest.approx([0.8 / 0.7] * 2)  # the same on every prompt
    assert drafter.tau_ratio == pytest.approx(4 / 3) and lookup.tau_ratio == pytest.approx(1.0)
    assert speculator_to_serve(v).environment == f"DFLASH_TRAIN_LOOKUP={setting}"
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    assert f"3, {name}" in text
    assert "of 12 blocks 8 came from lookup, 4 at steps that skipped the drafter's pass" in text
    assert ("against the drafter at K = 2, paired by prompt: τ per prompt 1.333 [1.333, 1.333]×, speedup 1.143 "
            "[1.143, 1.143]×") in text
    assert f"serve the drafter as below with `DFLASH_TRAIN_LOOKUP={setting}` set" in text
    assert f"{name} 3" in v.timing.plain_tokens_per_s_decode  # its plain runs: host drift


def test_a_prompt_a_later_engine_run_refuses_is_left_out_of_every_comparison(tiny_target, drafters, monkeypatch,
                                                                             tmp_path, capsys):
    """vLLM refuses a prompt in one engine run only: prompt lookup at its second K (in the first run), the combined
    speculator, the fp32 recheck of the drafter's one bf16 mismatch. Each is left out of every run's figures (the
    runs before it took it), named with its reason, and of the later runs' jobs; the recheck that refuses its prompt
    is no KeyError. A later run that refuses every prompt left is one line."""
    from dflash_train.engine import runner
    from dflash_train.errors import UserError
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS + ["Tell me a story."])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    why = {rid: f"VLLMValidationError: no {rid} here" for rid in prompts}
    spec_s = {3: 0.5, 1: 0.8, ("ngram", 2): 0.9, ("ngram", 4): 0.85, "combined": 0.6}
    calls: list = []

    def refuses(job) -> dict[str, str]:  # the timed run's lookup K = 4 refuses p2
        run = "check" if job.mode == "check" else tuple(job.free[-1]) if job.free else None
        rid = {("ngram", 4): "p2", ("combined", 3): "p1", "check": "p0"}.get(run)  # p0: the K = 3 bf16 mismatch
        return {rid: why[rid]} if rid else {}

    monkeypatch.setattr(runner, "run_engine", fake_engine(calls, natural, spec_s, {}, [], refuses=refuses))
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[3, 1],
                        concurrency=[], ngram=[2, 4], combined="k=2,confidence=1")
    v = engine_eval(config, tiny_target, prompts, 4, "bf16", "cpu", tmp_path)
    assert v.refused_by_engine == {rid: why[rid] for rid in ("p2", "p1", "p0")}
    kept = ["p3", "p4"]
    for row in v.sweep + v.ngram_sweep + [v.combined]:
        assert [p.id for p in row.per_prompt] == kept, row
        assert row.lossless_checked == 2 and row.lossless_mismatches == 0
    assert v.best_k == 3 and [p.id for p in v.per_prompt] == kept
    assert (v.lossless_checked, v.lossless_mismatches, v.mismatches) == (2, 0, [])
    assert {c.prompts for c in v.combined.against.values()} == {2}  # paired on the same prompts
    assert {r.prompts for r in v.ranking} == {2}  # and ranked on them
    timed, combined_job, recheck = calls
    assert [r.id for r in timed.requests] == ["p0", "p1", "p2", "p3", "p4"]
    assert [r.id for r in combined_job.requests] == ["p0", "p1", "p3", "p4"]  # not p2, refused before
    assert recheck.mode == "check" and [r.id for r in recheck.requests] == ["p0"]
    printed = capsys.readouterr().out
    for rid in ("p2", "p1", "p0"):
        assert f"engine: vLLM refused 1 prompt(s), left out of every comparison: {rid}: {why[rid]}" in printed
    monkeypatch.setattr(runner, "run_engine", fake_engine([], natural, spec_s, {}, [], refuses=lambda job: {
        r.id: "VLLMValidationError: none left" for r in job.requests} if job.combined else
        refuses(job)))
    with pytest.raises(UserError, match=r"^-: vLLM refused all 5 prompts \(e\.g\. p2: VLLMValidationError: no p2 "
                                        r"here\): nothing to evaluate$"):
        engine_eval(config, tiny_target, prompts, 4, "bf16", "cpu", tmp_path)


def test_combined_on_takes_its_rule_from_the_measured_taus_and_a_written_rule_stays_as_written():
    from dflash_train.spec_decode.lookup import CombinedRule
    from dflash_train.stages.evaluate.vllm_sweep import combined_rule

    tree = None if suffix_problem() else SUFFIX_SCORE  # the suffix tree where arctic-inference loads
    def measured(tau: float) -> KRow:
        return KRow(tau_steps=tau)

    assert combined_rule("on", measured(2.0), measured(1.5)) == CombinedRule(k=4, confidence=0.6, suffix=tree)
    assert combined_rule("on", measured(1.3), measured(1.5)) == CombinedRule(k=4, confidence=1, suffix=tree)
    assert combined_rule("on", measured(1.3), None) == CombinedRule(suffix=tree)  # lookup not timed: the default
    assert combined_rule("k=3,confidence=0.6", measured(1.3), measured(1.5)) == CombinedRule(k=3, confidence=0.6)


def test_prompt_lookup_is_timed_with_requests_together_and_the_tables_say_how_far_it_pays(tiny_target, drafters,
                                                                                         monkeypatch, tmp_path):
    """A user serving many requests at once serves the faster of the two at their batch: prompt lookup is timed at
    every concurrency the drafter is, its rows beside the drafter's, and how far each pays."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * 9 for i, rid in enumerate(prompts)}
    calls: list = []
    # batch 1: the drafter 0.9 s and lookup 0.8 s against plain's 1 s; 4 together: the drafter 1.6 s and lookup
    # 2.5 s against plain's 2 s (lookup loses there)
    monkeypatch.setattr(runner, "run_engine", fake_engine(calls, natural, {1: 0.9, "ngram": 0.8},
                                                          {1: 1.6, "ngram": 2.5}, []))
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1],
                        concurrency=[4], ngram=[3])
    v = engine_eval(config, tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
    assert calls[0].free == [("ngram", 3)] and calls[0].concurrency == [4]
    lookup = v.ngram
    assert [(r.requests, r.k) for r in lookup.concurrency] == [(1, 3), (4, 3)]
    assert lookup.concurrency[1].speedup == pytest.approx(2.0 / 2.5)
    assert lookup.pays_up_to_concurrency == 1 and v.pays_up_to_concurrency == 4
    assert [(r.requests, r.k) for r in v.concurrency] == [(1, 1), (4, 1)]  # the drafter's own, unchanged
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    assert "| 4 | **1** | 18 / 22.5 | 1.25× |" in text and "| 4 | 3, prompt lookup | 18 / 14.4 | 0.8× |" in text
    assert ("Speculation pays up to 4 requests decoded together (of those measured). Prompt lookup pays one "
            "request at a time only.") in text


def test_every_prompt_lookup_k_is_timed_beside_the_drafter_and_the_fastest_is_the_baseline(
        tiny_target, drafters, monkeypatch, tmp_path):
    """--ngram 2,4: both lookup K are timed in the drafter's job beside its first K, on the prompts of its reference
    pass, sharing plain decoding's runs (one job, no second reference pass); the fastest lookup K at batch 1 is the
    baseline."""
    from dflash_train.engine import runner
    from dflash_train.report_tables import serving_tables
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.vllm_sweep import engine_eval

    prompts = {f"p{i}": prompt_ids(tiny_target, text) for i, text in enumerate(PROMPTS[:4])}
    natural = {rid: [7 + i] * (9 + i) for i, rid in enumerate(prompts)}
    calls: list = []
    # batch 1 against plain's 1 s: the drafter 0.9 s, lookup K = 2 0.8 s, K = 4 0.7 s; 4 together against 2 s:
    # the drafter 1.6 s, lookup K = 2 1.9 s, K = 4 2.5 s
    monkeypatch.setattr(runner, "run_engine", fake_engine(
        calls, natural, {1: 0.9, ("ngram", 2): 0.8, ("ngram", 4): 0.7},
        {1: 1.6, ("ngram", 2): 1.9, ("ngram", 4): 2.5}, []))
    config = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", max_new_tokens=12, speculative_tokens=[1],
                        concurrency=[4], ngram=[2, 4])
    v = engine_eval(config, tiny_target, prompts, 4, "fp32", "cpu", tmp_path)
    assert [(c.speculative_tokens, c.free) for c in calls] == [([1], [("ngram", 2), ("ngram", 4)])]
    assert [row.k for row in v.ngram_sweep] == [2, 4]
    assert v.ngram.k == 4 and v.ngram.speedup == pytest.approx(1 / 0.7)
    assert v.ngram.engine_args["num_speculative_tokens"] == 4
    assert [(r.requests, r.k) for r in v.ngram.concurrency] == [(1, 2), (1, 4), (4, 2), (4, 4)]
    assert v.ngram.pays_up_to_concurrency == 4  # K = 2 pays at 4 together, K = 4 does not
    assert set(v.timing.plain_tokens_per_s_decode) == {"reference", "1", "prompt lookup 2", "prompt lookup 4"}
    assert v.best_k == 1 and [row.k for row in v.sweep] == [1]  # the drafter's own, unchanged
    text = "\n".join(serving_tables(v, Machine(cpu="Some CPU", cores=2)))
    assert "| 2, prompt lookup |" in text and "| 4, prompt lookup |" in text
    assert "1.429× at K = 4 (the fastest of K = 2, 4) against the drafter's 1.111× at best_k." in text
    assert "| 4 | 2, prompt lookup | 18 / 18.947 | 1.053× |" in text


class OracleDrafter(torch.nn.Module):
    """A drafter-shaped stub that knows the answer: its hidden state for the block slot at absolute position q
    is the one-hot of the target's own token there (`references[current]`, the prompt being decoded), so
    through an identity LM head it drafts the target's continuation; slots after `horizon` are made wrong, so
    it accepts exactly `horizon` drafts wherever labels exist. It ignores the context, hence online
    (DFlashProposer with its cache) and offline (the trainer's simulated_acceptance, all anchors in one
    forward) query one and the same proposer, and any gap comes from the definitions alone."""

    def __init__(self, references: list[list[int]], vocab: int, block_size: int, horizon: int):
        super().__init__()
        self.references = [torch.tensor(r) for r in references]
        self.current = 0
        self.vocab, self.horizon = vocab, horizon
        self.scale = torch.nn.Parameter(torch.ones(1))  # gives the callers a device and dtype
        self.block_size, self.mask_token_id, self.target_layer_ids = block_size, 5, [1]
        self.lm_head = None  # no draft vocabulary: the model's own `logits` drafts through the head it is given

    logits = DFlashDraftModel.logits

    def forward(self, position_ids, noise_embedding, target_hidden, attention_mask=None, attention_fn=None,
                past_key_values=None):
        ref = self.references[self.current]
        positions = position_ids[0, target_hidden.shape[1]:]  # the block's (the context's come first)
        tokens = ref[positions.clamp(max=len(ref) - 1)]
        slot = torch.arange(positions.shape[0]) % self.block_size
        tokens = torch.where(slot > self.horizon, (tokens + 1) % self.vocab, tokens)
        return torch.nn.functional.one_hot(tokens, self.vocab).float()[None] * self.scale


def test_offline_estimate_equals_online_tau_for_the_oracle(tiny_target):
    """At every anchor the decoding visited, offline acceptance equals the online step's, and the offline estimate
    (every anchor, walked as decoding walks it) equals the online tau at every horizon; the mean over every anchor
    is lower wherever the answer's end cuts the blocks short at anchors decoding does not visit."""
    from dflash_train.objective import simulated_acceptance

    model, V, B, n = tiny_target.model, tiny_target.config.vocab_size, 4, 21
    embed = model.get_input_embeddings()
    prompts = [prompt_ids(tiny_target, text) for text in PROMPTS]
    references = [reference(tiny_target, ids, n + B) for ids in prompts]
    identity_head = torch.nn.Linear(V, V, bias=False)
    identity_head.weight.data = torch.eye(V)
    for horizon in range(B):
        oracle = OracleDrafter(references, V, B, horizon)
        online_logs, samples = [], []
        for i, ids in enumerate(prompts):
            oracle.current = i
            gen = speculative_generate(model, ids, DFlashProposer(oracle, embed, identity_head), n, [])
            online_logs.append(gen.steps)
            S = len(ids) + len(gen.tokens)
            sample = {"input_ids": torch.tensor(ids + gen.tokens), "hidden_states": torch.zeros(S, 64),
                      "loss_mask": torch.arange(S) >= len(ids), "id": str(i), "weight": 1}
            samples.append(sample)
            confidence: list[float] = []
            per_anchor = simulated_acceptance(oracle, embed.weight, torch.eye(V), sample, block_size=B,
                                              confidence=confidence).tolist()
            assert len(per_anchor) == len(gen.tokens) - 1  # every response token with a next one is an anchor
            assert len(confidence) == len(per_anchor) and all(0 < p <= 1 for p in confidence)
            pos = len(ids)
            for step in gen.steps:  # the online anchors, in order
                assert per_anchor[pos - len(ids)] == 1 + min(horizon, S - 1 - pos)  # offline: within the response
                assert step.tau == 1 + step.accepted == 1 + horizon  # online: what the target verified
                if step.committed == step.accepted + 1:  # wherever the output does not end inside the drafts
                    assert per_anchor[pos - len(ids)] == step.tau
                pos += step.committed
        online = acceptance_stats(online_logs, B)
        offline = offline_estimate(_selecting(samples, oracle), oracle, embed.weight, torch.eye(V), B)
        assert offline.num_samples == len(prompts)
        assert offline.tau_steps == pytest.approx(online.tau_steps)
        assert offline.tau_per_prompt == pytest.approx(online.tau_per_prompt)
        assert offline.per_position_acceptance == pytest.approx(online.per_position_acceptance)
        assert offline.tau_by_k[-1] == pytest.approx(online.tau_per_prompt)
        if horizon <= 1:
            assert offline.tau_every_anchor == pytest.approx(online.tau_per_prompt) == pytest.approx(1 + horizon)
        else:  # only the tails differ: every anchor counts the ones the answer's end cuts short
            assert offline.tau_every_anchor < online.tau_per_prompt <= 1 + horizon


def _selecting(samples, oracle):
    for i, sample in enumerate(samples):
        oracle.current = i
        yield sample


# ------------------------------------------------------------------------------------------------ the command

LAYERS = [1, 4, 6]


@pytest.fixture(scope="module")
def drafters(tiny_target, tmp_path_factory):
    """Two untrained tiny drafters saved as they ship (block 4; the baseline with 2 layers and block 3)."""
    from test_spec_decode import tiny_drafter

    from dflash_train.model.checkpoint import save_drafter

    root = tmp_path_factory.mktemp("drafters")
    paths = []
    for name, block, layers, seed in (("main", 4, 1, 0), ("other", 3, 2, 1)):
        d, config = tiny_drafter(tiny_target, block_size=block, num_layers=layers, seed=seed)
        config.target = tiny_target.identity().to_dict()
        paths.append(save_drafter(d, config, root / name))
    return paths


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory):
    from dflash_train.stages.ingest.command import ingest
    from dflash_train.stages.ingest.config import IngestConfig

    out = tmp_path_factory.mktemp("prompts") / "p"
    ingest([REPO / "data/examples/prompts.jsonl", REPO / "data/examples/messages.jsonl"], out,
           IngestConfig(eval_fraction=0.5, max_prompt_tokens=0, progress=False))
    return out


@pytest.fixture(scope="module")
def store_dir(tiny_target, prompts_dir, tmp_path_factory):
    """Held-out samples as capture writes them: the target's greedy response and the tapped states."""
    from dflash_train.prompts import load_prompt_records
    from dflash_train.spec_decode.loop import plain_generate
    from dflash_train.store.writer import StoreWriter

    out = tmp_path_factory.mktemp("store") / "s"
    model = tiny_target.model
    records, _ = load_prompt_records(prompts_dir, "eval")
    with StoreWriter(out, target=tiny_target.identity().to_dict(), target_layer_ids=LAYERS, hidden_size=64,
                     generation={"template_kwargs": {}}) as writer:
        for r in records:
            ids = tiny_target.render(r.messages)
            new = plain_generate(model, ids, 12, tiny_target.stop_token_ids()).tokens
            full = torch.tensor([ids + new])
            with torch.no_grad():
                states = model(full, output_hidden_states=True).hidden_states
            writer.add(full[0], torch.arange(full.shape[1]) >= len(ids),
                       torch.cat([states[i + 1][0] for i in LAYERS], dim=-1), id=r.id)
    return out


def eval_cli(*args: str) -> int:
    from dflash_train.cli import main

    return main(["eval", "--engine", "own", "--dtype", "fp32", "--threads", "1", "--max-new-tokens", "12",
                 *map(str, args)])


def test_eval_command_writes_the_report(tiny_target, tiny_target_dir, drafters, prompts_dir, store_dir, tmp_path,
                                        capsys):
    from dflash_train.provenance import is_complete

    out = tmp_path / "eval"
    rc = eval_cli("--drafter", drafters[0], "--baseline-drafter", drafters[1], "--target", tiny_target_dir,
                  "--prompts", prompts_dir, "--split", "eval", "--store", store_dir, "--out", out)
    assert rc == 0
    assert is_complete(out)
    assert json.loads((out / "report.json").read_text())["schema_version"] == SCHEMA_VERSION
    report = eval_report.load(out)
    own, n = report.own, report.settings.num_prompts
    assert report.vllm is None and report.settings.options["drafter"] == str(drafters[0])
    assert n >= 1 and len(own.per_prompt) == n == own.lossless_checked
    assert own.lossless_mismatches == 0 and own.mismatches == []
    assert 1 <= own.tau_steps <= 4 and 1 <= own.tau_per_prompt <= 4 and len(own.per_position_acceptance) == 3
    assert own.tau_steps == pytest.approx(1 + sum(own.per_position_acceptance))
    lo, hi = own.tau_steps_interval
    assert lo <= own.tau_steps <= hi
    assert 1 <= report.offline.tau_steps <= 4 and report.offline.num_samples == n
    assert report.offline.samples_of_eval_prompts == n  # the store holds the same held-out prompts
    assert report.tau_gap == pytest.approx(own.tau_steps - report.offline.tau_steps)
    assert own.speedup == pytest.approx(own.tokens_per_s / own.tokens_per_s_baseline)
    assert report.target.config_hash == tiny_target.identity().config_hash
    methods = [m.method for m in own.methods]
    assert methods[0].startswith("plain") and methods[-1] == "block size 1" and len(methods) == 4
    assert [m.role for m in own.methods] == ["plain", "drafter", "baseline", "no_speculation"]
    assert [m.block_size for m in own.methods] == [1, 4, 3, 1]
    no_spec = own.methods[-1]
    assert no_spec.tau_steps == no_spec.tau_per_prompt == 1 and no_spec.lossless_mismatches == 0
    assert sum(own.methods[1].tau_histogram.values()) == own.methods[1].num_steps
    md = (out / "report.md").read_text()
    assert "| method |" in md and "Offline estimate" in md and "0 of" in md
    for png in ("acceptance_by_position.png", "tau_histogram.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["config"]["drafter"] == str(drafters[0]) and prov["target"]["name"] == str(tiny_target_dir)
    assert "| method |" in capsys.readouterr().out


def test_the_vllm_sweep_starts_where_the_held_out_estimate_keeps_tau(tiny_target_dir, drafters, prompts_dir,
                                                                      store_dir, tmp_path, monkeypatch):
    """The offline estimate runs before the engine, and its tau at each K picks the sweep's first K."""
    from dflash_train.engine import install, runner
    from dflash_train.stages.evaluate.vllm_sweep import sweep_first_k

    calls: list = []

    def run_engine(job, workdir, what):
        natural = {r.id: [7] * 9 for r in job.requests}
        return fake_engine(calls, natural, dict.fromkeys((1, 2, 3), 0.5), dict.fromkeys((1, 2, 3), 2.0), [])(
            job, workdir, what)

    monkeypatch.setattr(install, "check_vllm", lambda: None)
    monkeypatch.setattr(runner, "run_engine", run_engine)
    out = tmp_path / "eval"
    assert eval_cli("--engine", "vllm", "--drafter", drafters[0], "--target", tiny_target_dir, "--prompts",
                    prompts_dir, "--split", "eval", "--store", store_dir, "--out", out) == 0
    report = eval_report.load(out)
    first = report.vllm.timing.first_k
    assert first.k == sweep_first_k(report.offline.tau_by_k) == calls[0].speculative_tokens[0]
    assert first.source == "offline estimate" and sorted(calls[0].speculative_tokens) == [1, 2, 3]


@pytest.mark.parametrize("edit, message", [
    ({"dflash_config": {"target_layer_ids": [1, 4, 8]}}, "include [8]"),
    ({"vocab_size": 2048}, "vocab size 2048"),
    ({"num_target_layers": 30}, "30-layer target"),
    ({"dflash_train": {"target": {"name": "other", "tokenizer_hash": "0" * 64}}}, "tokenizer differs"),
])
def test_mismatched_drafter_is_refused_before_decoding(tiny_target_dir, drafters, prompts_dir, tmp_path, capsys,
                                                       edit, message, monkeypatch):
    import shutil
    import tempfile

    scratch = tmp_path / "scratch"  # where the eval's engine folder goes: a refused eval leaves nothing there
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    bad = tmp_path / "bad"
    shutil.copytree(drafters[0], bad)
    config = json.loads((bad / "config.json").read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    rc = eval_cli("--drafter", bad, "--target", tiny_target_dir, "--prompts", prompts_dir, "--out", out)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and str(bad) in err, err
    assert not out.exists() and not any(scratch.iterdir())


def test_empty_prompt_set_is_refused(tiny_target_dir, drafters, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", empty,
                  "--out", tmp_path / "eval")
    err = capsys.readouterr().err
    assert rc == 2 and "no prompts" in err and str(empty) in err, err


def test_mismatch_diagnosis_and_fp32_recheck(tiny_target, tiny_target_dir, drafters):
    """The path a bf16 tie takes: where the outputs part, the margin there, and the fp32 rerun of both."""
    from dflash_train.stages.evaluate.config import EvalConfig
    from dflash_train.stages.evaluate.own_loop import (NO_SPECULATION, PLAIN, Method, _load_proposer, diagnose_mismatch,
                                                       recheck_in_fp32)
    from dflash_train.spec_decode.loop import NoDraft, plain_generate

    ids = prompt_ids(tiny_target, PROMPTS[0])
    plain = plain_generate(tiny_target.model, ids, 12, []).tokens
    broken = plain[:5] + [(plain[5] + 1) % 1024] + plain[6:]
    info = diagnose_mismatch(tiny_target, ids, plain, broken, "p")
    assert info.index == 5 and info.plain_token == plain[5] and info.spec_token == broken[5]
    assert info.top2_margin > 0
    cfg = EvalConfig(drafter=str(drafters[0]), prompts="-", out="-", target=str(tiny_target_dir), max_new_tokens=12)
    methods = [Method(PLAIN, "plain", None),
               Method("drafter", "drafter", _load_proposer(cfg.drafter, tiny_target, None, torch.float32),
                      cfg.drafter, 4), Method(NO_SPECULATION, "no_speculation", NoDraft())]
    details = [dataclasses.replace(info, method="drafter"), dataclasses.replace(info, method=NO_SPECULATION)]
    recheck_in_fp32(cfg, "cpu", methods, details, {"p": ids}, {"p": broken})
    for d in details:
        assert d.fp32_spec_equals_plain is True and d.plain_equals_fp32_plain is False


def test_prompts_all_too_long_are_refused(tiny_target_dir, drafters, prompts_dir, tmp_path, capsys):
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", prompts_dir,
                  "--max-prompt-tokens", "5", "--out", tmp_path / "eval")
    err = capsys.readouterr().err
    assert rc == 2 and "longer than --max-prompt-tokens 5" in err, err


def test_eval_command_with_sampling_is_lossless_too(tiny_target_dir, drafters, prompts_dir, tmp_path):
    """At temperature > 0 the target's samples are keyed on (seed, prompt, position), so plain and speculative
    sampling must still give the same tokens."""
    out = tmp_path / "eval"
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", prompts_dir,
                  "--temperature", "1.0", "--seed", "3", "--limit", "2", "--no-warmup", "--out", out)
    report = eval_report.load(out)
    assert rc == 0 and report.own.lossless_mismatches == 0 and report.own.lossless_checked >= 1
    assert report.settings.sampling.startswith("temperature 1.0")


def test_a_step_cost_is_read_off_a_ks_timed_runs_and_drawn_through_two_k():
    """A verification step's cost in plain decoding steps: the speculative side's decode seconds per step over
    plain decoding's per token, on the same prompts at the same lengths."""
    from dflash_train.engine.jobs import EngineOutput
    from dflash_train.stages.evaluate.vllm_sweep import k_row, step_cost_line

    def timed(i: int, accepted: list[int], plain_s: float, spec_s: float) -> tuple[dict, dict]:
        tokens = 1 + sum(a + 1 for a in accepted)
        output = {"id": f"p{i}", "token_ids": [5] * tokens, "finish_reason": "length", "decode_s": spec_s,
                  "accepted": accepted}
        return {"id": f"p{i}", "tokens": tokens, **{f"{side}_{clock}": [s] * n for side, s, n in
                                                    (("plain", plain_s, 1), ("spec", spec_s, 2))
                                                    for clock in ("core_s", "decode_s", "wall_s")}}, output

    def cost(batch1: list[dict], outputs: list[dict]) -> float | None:
        natural = {o["id"]: EngineOutput(**o) for o in outputs}
        run = {"k": 3, "load_s": 1.0, "seconds": 9.0, "batch1": batch1, "outputs": outputs}
        return k_row(run, natural, greedy=True).step_cost

    # 9 decode tokens in 4 steps (accepting 2, 1, 0, 2) and 5 in 5: 14 plain tokens in 1.4 s; 9 steps in 1.8 s
    (a, out_a), (b, out_b) = timed(0, [2, 1, 0, 2], 0.9, 0.8), timed(1, [0] * 5, 0.5, 1.0)
    assert cost([a, b], [out_a, out_b]) == pytest.approx((1.8 / 9) / (1.4 / 14))
    assert cost([{**a, "plain_decode_s": [0.0]}], [out_a]) is None
    assert step_cost_line({15: 2.13, 1: 1.43}) == pytest.approx([1.38, 0.05])
    assert step_cost_line({1: 1.5, 15: 1.4}) == [1.5, 0.0]  # noise never makes a longer block cheaper


@pytest.mark.parametrize("value", ["1", "1,2,3", "0,0.1", "1,-0.1", "nan,0", "a,b"])
def test_eval_refuses_a_step_cost_that_is_not_a_line(tmp_path, capsys, value):
    from dflash_train.cli import main

    try:
        rc = main(["eval", "--drafter", str(tmp_path / "d"), "--prompts", str(tmp_path / "p"), "--out",
                   str(tmp_path / "out"), "--step-cost", value])
    except SystemExit as exit_:  # not numbers: argparse's own line
        rc = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "--step-cost" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ["vllm", "both"])
def test_vllm_refuses_two_baseline_drafters_in_one_line(drafters, tmp_path, capsys, engine):
    """vLLM times one baseline drafter beside the drafter (the project's loop takes several): two with --engine
    vllm or both are refused in one line, before anything is loaded or written."""
    from dflash_train.cli import main

    assert main(["eval", "--engine", engine, "--drafter", str(drafters[0]), "--baseline-drafter", str(drafters[1]),
                 "--baseline-drafter", str(drafters[0]), "--prompts", str(tmp_path / "p"), "--out",
                 str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--baseline-drafter: vLLM times one baseline drafter" in err[0], err
    assert f"2 were given with --engine {engine}" in err[0] and "--engine own, takes several" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "2.5"])
def test_eval_refuses_a_temperature_out_of_the_api_range(tmp_path, capsys, value):
    """`eval --temperature nan` decoded and called the run lossless."""
    from dflash_train.cli import main

    assert main(["eval", "--drafter", str(tmp_path / "d"), "--prompts", str(tmp_path / "p"), "--out",
                 str(tmp_path / "out"), "--temperature", value]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("dflash-train eval: error: --temperature ")
    assert "must be a finite" in err[0]
    assert not (tmp_path / "out").exists()


def test_eval_renders_tool_traffic_like_capture(tiny_target, tiny_target_dir, drafters, tmp_path):
    """Eval renders a prompt's tool turns and definitions through the same function as capture."""
    from dflash_train.prompts import load_prompt_records

    log = tmp_path / "agents.jsonl"
    log.write_text(json.dumps(TOOL_CALL_REQUEST) + "\n")
    (record,), _ = load_prompt_records(log)
    rendered = tiny_target.render(record.messages, record.tools)
    assert len(rendered) > len(tiny_target.render(record.messages))  # the tools block is part of the prompt
    assert eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", log, "--no-warmup",
                    "--out", tmp_path / "eval") == 0
    assert eval_report.load(tmp_path / "eval").own.per_prompt[0].prompt_tokens == len(rendered)


# --- refusals: training prompts, damaged inputs, the output folder ---------------------------------------------------


def trained_on(drafter: Path, out: Path, store: Path | None, prompt_set: dict | None = None) -> Path:
    """A copy of `drafter` whose training_args.json says it was trained on `store` (with its recorded prompt set)."""
    import shutil

    shutil.copytree(drafter, out)
    entry = {"path": str(store), "num_samples": 1, **({"prompts": prompt_set} if prompt_set else {})}
    (out / "training_args.json").write_text(json.dumps({"recipe": {}, "data": {"stores": [entry]}, "run": {}}))
    return out


def test_eval_refuses_prompts_the_drafter_was_trained_on(tiny_target_dir, drafters, prompts_dir, tmp_path, capsys):
    from dflash_train.prompts import load_prompt_records, prompt_set
    from dflash_train.errors import UserError
    from dflash_train.stages.evaluate.command import check_held_out
    from dflash_train.store.writer import StoreWriter

    train, _ = load_prompt_records(prompts_dir, "train")
    held_out, _ = load_prompt_records(prompts_dir, "eval")
    store = tmp_path / "train-store"
    with StoreWriter(store, target={"name": "tiny"}, target_layer_ids=[1], hidden_size=4) as writer:
        for r in train:  # a store of the train split's prompts: only their ids matter here
            writer.add(torch.arange(4), torch.ones(4, dtype=torch.bool), torch.zeros(4, 4), id=r.id)
    drafter = trained_on(drafters[0], tmp_path / "drafter", store)
    out = tmp_path / "eval"
    rc = eval_cli("--drafter", drafter, "--target", tiny_target_dir, "--prompts", prompts_dir, "--split", "train",
                  "--out", out)
    err = capsys.readouterr().err
    assert rc == 2 and f"{len(train)} of the {len(train)} prompts to evaluate" in err and str(store) in err, err
    assert "overstates" in err and not out.exists()
    checked = check_held_out(str(drafter), {r.id for r in held_out}, "prompts", prompt_set(prompts_dir, "eval", None))
    assert checked.by_id == [str(store)]
    # a training store that is not on this machine: the prompt set it recorded decides
    elsewhere = trained_on(drafters[0], tmp_path / "drafter2", tmp_path / "gone", prompt_set(prompts_dir, "train", None))
    with pytest.raises(UserError, match="the prompts are training prompts"):
        check_held_out(str(elsewhere), {r.id for r in train}, "prompts", prompt_set(prompts_dir, "train", None))
    checked = check_held_out(str(elsewhere), {r.id for r in held_out}, "prompts", prompt_set(prompts_dir, "eval", None))
    assert checked.by_prompt_set == [str(tmp_path / "gone")]
    # --training-prompts (an overfit check) evaluates them and counts them in the report
    checked = check_held_out(str(drafter), {r.id for r in train}, "prompts", prompt_set(prompts_dir, "train", None),
                             allow=True)
    assert checked.training_prompts == len(train)
    checked = check_held_out(str(elsewhere), {r.id for r in train}, "prompts", prompt_set(prompts_dir, "train", None),
                             allow=True)
    assert checked.training_prompts == len(train)


def test_eval_refuses_a_store_with_a_corrupted_shard(tiny_target_dir, drafters, prompts_dir, store_dir, tmp_path,
                                                    capsys, monkeypatch):
    import shutil

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "store"
    shutil.copytree(store_dir, bad)
    shard = next(bad.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", prompts_dir, "--store", bad,
                  "--out", tmp_path / "eval")
    err = capsys.readouterr().err
    assert rc == 2 and f"shard {shard.name} is corrupted" in err, err


def test_eval_refuses_a_token_only_store_in_one_line(tiny_target, tiny_target_dir, drafters, prompts_dir, tmp_path,
                                                     capsys, monkeypatch):
    """The offline estimate reads the stored states: a store captured with --storage none is one line, not a
    KeyError from the first sample."""
    from dflash_train.prompts import load_prompt_records
    from dflash_train.store.writer import StoreWriter

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    tokens = tmp_path / "tokens"
    records, _ = load_prompt_records(prompts_dir, "eval")
    with StoreWriter(tokens, target=tiny_target.identity().to_dict(), target_layer_ids=LAYERS, hidden_size=64,
                     generation={"template_kwargs": {}}, storage_dtype="none") as writer:
        for r in records:
            ids = torch.tensor(tiny_target.render(r.messages) + [5, 6])
            writer.add(ids, torch.arange(len(ids)) >= len(ids) - 2, None, id=r.id)
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", prompts_dir, "--store", tokens,
                  "--out", tmp_path / "eval")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert f"--store {tokens} is a token-only store" in err
    assert not (tmp_path / "eval").exists()


def test_a_prompt_record_out_of_range_is_one_line_naming_its_id_and_key(tiny_target_dir, drafters, tmp_path,
                                                                         capsys):
    """The records are checked by the rule ingest and capture check them with (sampling.check_record), before the
    target is loaded: a penalty vLLM refuses would otherwise stop the engine mid-eval."""
    from tiny import write_prompt_folder

    folder = write_prompt_folder(tmp_path / "prompts", [("fine", None, None),
                                                        ("bad", None, {"frequency_penalty": -7.0})])
    out, _ = tmp_path / "eval", capsys.readouterr()  # what writing the folder printed
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", folder, "--split", "eval",
                  "--out", out)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and err == ["dflash-train eval: error: prompt bad: logged frequency_penalty must be a number in "
                               "[-2, 2], got -7.0"], err
    assert not out.exists()


def test_a_damaged_drafter_weights_file_is_one_line(tiny_target_dir, drafters, prompts_dir, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(drafters[0], bad)
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:1000])
    rc = eval_cli("--drafter", bad, "--target", tiny_target_dir, "--prompts", prompts_dir, "--out", tmp_path / "e")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash-train eval: error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"{bad / 'model.safetensors'} is not a readable safetensors file" in errors[0]


def test_a_drafter_with_non_finite_weights_is_one_line_naming_the_file_and_tensor(tiny_target_dir, drafters,
                                                                                  prompts_dir, tmp_path, capsys):
    """Not a tau of 1.00 and a slowdown without a word: the NaN is named where it is."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = Path(shutil.copytree(drafters[0], tmp_path / "bad"))
    state = load_file(str(bad / "model.safetensors"))
    state["layers.0.mlp.up_proj.weight"][2, 3] = float("nan")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    rc = eval_cli("--drafter", bad, "--target", tiny_target_dir, "--prompts", prompts_dir, "--out", tmp_path / "e")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash-train eval: error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert (f"{bad / 'model.safetensors'}: tensor layers.0.mlp.up_proj.weight holds 1 NaN and 0 inf value(s): the "
            f"drafter's weights are damaged") in errors[0]
    assert not (tmp_path / "e").exists()


def test_a_training_record_linked_out_of_the_drafter_folder_is_never_read(drafters, tmp_path):
    import shutil

    from dflash_train.errors import UserError
    from dflash_train.stages.evaluate.command import check_held_out

    folder = Path(shutil.copytree(drafters[0], tmp_path / "d"))
    (tmp_path / "elsewhere.json").write_text(json.dumps({"data": {"stores": []}}))
    (folder / "training_args.json").unlink(missing_ok=True)
    (folder / "training_args.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserError, match=f"{folder / 'training_args.json'} names a file outside the drafter folder"):
        check_held_out(str(folder), {"p0"}, "prompts", None)


def test_eval_refuses_an_out_folder_it_did_not_write(tiny_target_dir, drafters, prompts_dir, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    rc = eval_cli("--drafter", drafters[0], "--target", tiny_target_dir, "--prompts", prompts_dir, "--out", out)
    assert rc == 2 and "already holds files that eval did not write (todo.txt)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["todo.txt"]


def test_read_only_eval_folder_is_one_line(tiny_target_dir, drafters, prompts_dir, tmp_path):
    import os
    import sys

    from sandbox import run_with_mount

    ro = tmp_path / "ro"
    proc = run_with_mount([sys.executable, "-m", "dflash_train", "eval", "--engine", "own", "--drafter",
                           str(drafters[0]), "--target", str(tiny_target_dir), "--prompts", str(prompts_dir),
                           "--out", str(ro)], ro, read_only=True, env=dict(os.environ), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"dflash-train eval: error: cannot write {ro}: read-only file system. Choose a writable folder"
