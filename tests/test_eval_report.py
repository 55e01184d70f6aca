"""eval_report: the eval report's schema, its versions, and every report.json committed under results/."""

import json
import math

import pytest

from conftest import REPO_ROOT

from dflash_train import eval_report
from dflash_train.errors import UserError
from dflash_train.eval_report import (SCHEMA_VERSION, CombinedEntry, EvalReport, KRow, Mismatch, OwnLoop, Paired,
                                      SourceCount, SpeculatorEntry, SweepTiming, TimedPrompt, VllmEval)

RESULTS = sorted((REPO_ROOT / "results").rglob("report.json"))


def test_every_report_under_results_loads_through_the_schema():
    assert len(RESULTS) >= 40
    for path in RESULTS:
        report = eval_report.load(path)
        online = report.online
        assert online is not None and online.tau_steps is not None, path
        assert 1 <= online.tau_steps <= report.block_size, path
        assert report.vllm is None or report.vllm.best_k in {row.k for row in report.vllm.sweep}, path
        assert report.vllm is None or report.vllm.baseline is None, path  # written before it (schema 1.2)
        again = eval_report.from_json(json.loads(json.dumps(eval_report.to_json(report))), str(path))
        assert again == report, path  # what the schema writes, it reads back unchanged


def test_a_report_round_trips_through_json_with_its_records_typed(tmp_path):
    prompt = TimedPrompt(id="p0", new_tokens=9, tau=2.5, plain_core_s=1.0, spec_core_s=0.5)
    row = KRow(k=3, tau_steps=2.4, tau_steps_interval=[2.1, 2.6], per_prompt=[prompt],
               mismatches=[Mismatch(id="p0", index=4, plain_token=7, spec_token=8, fp32_spec_equals_plain=True)])
    combined = CombinedEntry(k=4, setting="k=4,confidence=0.6", sources={"lookup": SourceCount(blocks=3)})
    baseline = SpeculatorEntry(k=3, tau_steps=2.0, per_prompt=[prompt], engine_args={"method": "dflash"})
    report = EvalReport(block_size=4, vllm=VllmEval(best_k=3, sweep=[row], combined=combined,
                                                     timing=SweepTiming(skipped_k=[2]), baseline=baseline,
                                                     baseline_sha256="0" * 64,
                                                     against_baseline=Paired(prompts=1, k=3, tau_ratio=1.2)),
                        own=OwnLoop(tau_steps=2.2, tau_per_prompt=2.3))
    eval_report.dump(report, tmp_path / "report.json")
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["schema_version"] == SCHEMA_VERSION and written["vllm"]["sweep"][0]["tau_steps"] == 2.4
    back = eval_report.load(tmp_path)  # the folder or the file
    assert back == report
    assert isinstance(back.vllm.sweep[0].per_prompt[0], TimedPrompt)
    assert back.vllm.combined.sources["lookup"].blocks == 3 and back.vllm.sweep[0].mismatches[0].index == 4
    assert isinstance(back.vllm.baseline.per_prompt[0], TimedPrompt) and back.vllm.against_baseline.tau_ratio == 1.2


def test_a_figure_over_nothing_is_written_as_null():
    written = eval_report.to_json(EvalReport(own=OwnLoop(tau_steps=math.nan, per_position_acceptance=[math.inf])))
    assert written["own"]["tau_steps"] is None and written["own"]["per_position_acceptance"] == [None]


def test_an_unknown_major_version_is_refused_in_one_line(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"schema_version": "2.0", "block_size": 8}))
    with pytest.raises(UserError) as err:
        eval_report.load(path)
    assert str(path) in str(err.value) and "schema version 2.0" in str(err.value) and "\n" not in str(err.value)


def test_a_newer_minor_version_loads_ignoring_the_fields_it_adds(tmp_path):
    raw = eval_report.to_json(EvalReport(block_size=8, own=OwnLoop(tau_steps=2.0)))
    raw.update(schema_version="1.7", a_later_field={"x": 1})
    raw["own"]["another_one"] = 3
    report = eval_report.from_json(raw)
    assert report.own.tau_steps == 2.0 and report.block_size == 8


def test_a_report_of_major_0_is_read_with_tau_per_prompt_and_the_loop_under_own():
    """Before schema_version, `tau` was the mean over prompts, the project's loop sat at the top level and vLLM in
    engines.vllm, the eval's flags flat in settings."""
    raw = {"tau": 2.4, "tau_interval": [2.2, 2.6], "tau_steps": 2.3, "lossless_mismatches": 0, "lossless_checked": 2,
           "block_size": 8, "methods": [{"method": "drafter x", "role": "drafter", "tau": 2.4, "tau_steps": 2.3}],
           "mismatches": [{"id": "p1", "method": "drafter x", "index": 3, "plain_token": 5, "spec_token": 6}],
           "settings": {"prompts": "data/prompts", "max_new_tokens": 64, "dtype": "bf16", "num_prompts": 2},
           "engines": {"own": {"engine": "own", "tau": 2.4},
                       "vllm": {"engine": "vllm", "tau": 2.0, "tau_steps": 1.9, "best_k": 3,
                                "ngram": {"k": 2, "tau": 1.5, "speedup": 1.1},
                                "timing": {"first_k": {"k": 3, "from": "offline estimate", "slack": 0.01}}}}}
    report = eval_report.from_json(raw)
    assert (report.own.tau_steps, report.own.tau_per_prompt, report.own.tau_per_prompt_interval) == (2.3, 2.4,
                                                                                                   [2.2, 2.6])
    assert report.own.methods[0].tau_per_prompt == 2.4 and report.own.mismatches[0].plain_token == 5
    assert (report.vllm.tau_steps, report.vllm.tau_per_prompt) == (1.9, 2.0)
    assert report.vllm.ngram_sweep[0].k == 2 and report.vllm.ngram.tau_per_prompt == 1.5  # one lookup K: its row
    assert report.vllm.timing.first_k.source == "offline estimate"
    assert report.settings.options == {"prompts": "data/prompts", "max_new_tokens": 64}
    assert report.settings.dtype == "bf16" and report.settings.num_prompts == 2
    engine_only = eval_report.from_json({**raw, "methods": [], "engines": {"vllm": raw["engines"]["vllm"]}})
    assert engine_only.own is None and engine_only.online is engine_only.vllm


def test_a_file_that_is_not_a_report_is_one_line(tmp_path):
    (tmp_path / "report.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        eval_report.load(tmp_path)
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot be read"):
        eval_report.load(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        eval_report.load(tmp_path / "elsewhere" / "report.json")
