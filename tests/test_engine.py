"""The serving engine in the loop, with the real vLLM (its CPU build): our drafter folders load as its `dflash`
speculator, decode losslessly and get drafts accepted; `capture --engine vllm` stores what the one-pass capture
stores; a failing engine is one line. The pieces that need no engine (step accounting, the serve command, the
error line) are tested without one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_train import eval_report
from dflash_train.engine.args import serve_command
from dflash_train.engine.install import vllm_version
from dflash_train.engine.jobs import EngineOutput, engine_steps
from dflash_train.engine.runner import engine_error
from dflash_train.report_tables import fmt
from dflash_train.eval_report import ConstraintsSummary
from conftest import default_sigint
from test_capture import teacher_forced
from test_trainer import launch, read_metrics, write_recipe

REPO = Path(__file__).resolve().parent.parent
needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed (make install installs it)")
PROMPTS = ["Tell me about the sea.", "Write a poem about Paris.", "How do I add two numbers in Python?",
           "What is the capital of Italy?", "Hello! How can you help me today?", "Give me three points about Rome."]
LAYERS = [1, 3, 5]
NEW_TOKENS = 24
# vLLM and the project's loop run the same drafter on the same blocks in fp32: their taus differ only where rounding
# flips a near tie between two tokens (on a 2-core AMD EPYC: 1.538 and 1.546 at K = 1, 6.37 and 6.67 at K = 7), far
# less than another block moves them (there slot 1 is accepted 0.91 of the time in the whole block of 8, 0.53 in
# a block of 2: tau 1.91 against 1.55 at K = 1)
SAME_DRAFTS = 0.1


# --- without an engine ------------------------------------------------------------------------------------------


def test_engine_steps_keep_the_drafts_vllm_accepted_before_the_cut():
    """vLLM counts the drafts it accepted before the output was cut, and so does tau (as the reference does);
    the committed counts account for the output exactly."""
    out = EngineOutput(id="a", token_ids=list(range(1 + 4 + 1 + 2)), finish_reason="length", decode_s=1.0,
                       accepted=[3, 0, 5], drafted=[7, 7, 7])
    steps, left = engine_steps(out)
    assert [(s.accepted, s.committed) for s in steps] == [(3, 4), (0, 1), (5, 2)] and left == 0
    assert [s.tau for s in steps] == [4, 1, 6]
    no_steps, left = engine_steps(EngineOutput(id="b", token_ids=[1, 2, 3], finish_reason="stop", decode_s=0.1))
    assert no_steps == [] and left == 2  # tokens no verification step accounts for are reported, not hidden


def test_prompt_lookup_steps_without_a_match_count_as_plain_steps():
    """vLLM records no step where prompt lookup drafted nothing: each token no recorded step accounts for is a
    plain decoding step (tau 1), so tau stays tokens per target forward instead of skipping the misses."""
    out = EngineOutput(id="a", token_ids=list(range(1 + 3 + 1 + 1 + 1)), finish_reason="length", decode_s=1.0,
                       accepted=[2, 0], drafted=[4, 4])
    steps, left = engine_steps(out, undrafted_steps=True)
    assert [(s.accepted, s.committed) for s in steps] == [(2, 3), (0, 1), (0, 1), (0, 1)] and left == 0
    assert sum(s.tau for s in steps) / len(steps) == 1.5  # 6 tokens in 4 forwards, not 4 in 2 (2.0)


def test_the_engine_childs_progress_lines_show_on_the_stages_output_as_they_come(tmp_path, capsys):
    """An eval's sweep runs for minutes inside the engine's child: its line after each K it timed is printed by the
    stage as it comes (the rest stays in the log); a child past its time limit is reported, not waited for."""
    from dflash_train.engine.runner import wait_showing_progress

    log_path = tmp_path / "engine.log"
    child = ("import time; print('vLLM loading', flush=True); time.sleep(0.5); "
             "print('timed: K=5 done in 111 s (151 s in all)', flush=True); time.sleep(0.5); "
             "print('timed: prompt lookup K=4 done in 113 s (264 s in all)', end='', flush=True)")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=log, stderr=subprocess.STDOUT)
        assert wait_showing_progress(proc, log_path, None, every_s=0.1)
    assert capsys.readouterr().out.splitlines() == ["engine: K=5 done in 111 s (151 s in all)",
                                                    "engine: prompt lookup K=4 done in 113 s (264 s in all)"]
    assert "vLLM loading" in log_path.read_text()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=log)
        started = time.monotonic()
        assert not wait_showing_progress(proc, log_path, 0.5, every_s=0.1)
        assert time.monotonic() - started < 5
        proc.kill()
        proc.wait()


def test_serve_command_names_the_hub_repos_not_local_folders():
    kwargs = {"model": "/home/me/target", "dtype": "float32", "max_model_len": 512, "seed": 0, "enforce_eager": True,
              "speculative_config": {"method": "dflash", "model": "/home/me/run/drafter", "num_speculative_tokens": 15}}
    command = serve_command(kwargs, model="org/target", drafter="org/drafter")
    assert command.startswith("vllm serve org/target --dtype float32 --max-model-len 512 --seed 0 --enforce-eager")
    assert '"model":"org/drafter"' in command and "/home/me" not in command


def test_the_users_engine_arguments_go_over_the_jobs(tiny_target_dir):
    """`--engine-args` reach vLLM as given, after the job's own; a GPU memory share replaces the job's KV-cache
    size (vLLM would let the byte count win)."""
    from dflash_train.engine.jobs import EngineJob

    job = EngineJob(target=str(tiny_target_dir), requests=[], stop_token_ids=[2], drafter=str(tiny_target_dir),
                    mode="timed", concurrency=[4, 16], engine_args={"max_num_seqs": 8, "tensor_parallel_size": 2})
    kwargs = job.llm_kwargs(3)
    assert kwargs["max_num_seqs"] == 8 and kwargs["tensor_parallel_size"] == 2 and kwargs["kv_cache_memory_bytes"]
    assert kwargs["speculative_config"] == {"method": "dflash", "model": str(tiny_target_dir),
                                            "num_speculative_tokens": 3}
    assert "speculative_config" not in job.llm_kwargs() and job.llm_kwargs()["max_num_seqs"] == 8
    job.engine_args = {"gpu_memory_utilization": 0.5}
    assert "kv_cache_memory_bytes" not in job.llm_kwargs(3) and job.llm_kwargs(3)["max_num_seqs"] == 16


def test_engine_error_is_the_root_cause_not_the_wrapper(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("\n".join([
        "(Worker pid=1) ERROR [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention configuration: "
        "head_dim=16 isa=2 kv_cache_idx=0",
        "(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: Worker failed with error 'Unsupported CPU attention "
        "configuration: head_dim=16'",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]))
    assert engine_error(log) == "RuntimeError: Worker failed with error 'Unsupported CPU attention configuration: " \
                                "head_dim=16'"
    log.write_text("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                   "  Value error, bad speculative config [type=value_error, input_value=...]\n")
    assert engine_error(log).endswith(": Value error, bad speculative config")
    log.write_text("[rank0]: pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                   "[rank0]:   Value error, Model Runner V1 does not support: mixed sliding/full dflash drafts "
                   "[type=value_error]\n"
                   "[rank0]:     For further information visit https://errors.pydantic.dev/2.13/v/value_error\n")
    assert engine_error(log) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig: "
                                 "Value error, Model Runner V1 does not support: mixed sliding/full dflash drafts")


# --- with vLLM ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_target(tmp_path_factory) -> Path:
    """The tiny random Llama with head_dim 32 (vLLM's CPU attention supports 32 and up)."""
    from tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("engine_target"), num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    return path


def capture_cli(*args) -> int:
    from dflash_train.cli import main

    return main(["capture", "--dtype", "fp32", "--threads", "1", "--layers", ",".join(map(str, LAYERS)),
                 "--max-new-tokens", str(NEW_TOKENS), *map(str, args)])


@pytest.fixture(scope="module")
def engine_store(engine_target, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "vllm"
    assert capture_cli("--engine", "vllm", "--prompts", prompts_file, "--target", engine_target, "--out", out,
                       "--engine-args", '{"max_num_seqs": 4}') == 0
    return out


@needs_vllm
@pytest.mark.slow
def test_engine_capture_equals_the_one_pass_capture_and_a_teacher_forced_forward(engine_target, engine_store,
                                                                                 prompts_file, tmp_path):
    from dflash_train.store.reader import open_store
    from dflash_train.store.verify import verify_store
    from dflash_train.target import load_target

    own = tmp_path / "own"
    assert capture_cli("--prompts", prompts_file, "--target", engine_target, "--out", own) == 0
    engine, one_pass = open_store(engine_store), {s["id"]: s for s in open_store(own)}
    assert len(engine) == len(one_pass) == len(PROMPTS) and verify_store(engine_store) == []
    generation = engine.manifest["generation"]
    assert generation["engine"] == "vllm" and generation["engine_version"] == vllm_version()
    assert engine.manifest["capture"]["engine_args"] == {"max_num_seqs": 4}  # recorded, and given to the engine:
    assert json.loads((engine_store / "engine" / "job.json").read_text())["engine_args"] == {"max_num_seqs": 4}
    target = load_target(str(engine_target), dtype=torch.float32)
    for sample in engine:
        ref = one_pass[sample["id"]]
        assert sample["input_ids"].tolist() == ref["input_ids"].tolist()  # greedy: the same tokens
        assert sample["loss_mask"].tolist() == ref["loss_mask"].tolist()
        expected = teacher_forced(target.model, sample["input_ids"].tolist())  # the same LAYERS
        torch.testing.assert_close(sample["hidden_states"].float(), expected, rtol=1.6e-2, atol=1e-2)  # bf16 storage


@pytest.fixture(scope="module")
def overfit_drafter(engine_store, tmp_path_factory) -> Path:
    """A drafter trained to overfit the engine-captured responses (the target's own greedy outputs) and their states
    as vLLM's forwards recorded them: 300 steps. At 120 (simulated tau 7.05 of 8, against 7.09) the drafter trained
    on those states drafted 6.50 in vLLM against 7.53 in the project's loop at K = 7: its near-ties fall apart under
    either engine's rounding; at 300 the two agree."""
    work = tmp_path_factory.mktemp("overfit")
    recipe = write_recipe(work / "r.yaml", engine_store, work / "run", drafter={"num_layers": 2, "block_size": 8},
                          objective={"num_anchors": 32}, train={"max_steps": 300, "micro_batch_size": 6,
                                                                "precision": "fp32"})
    proc = launch(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (final,) = read_metrics(work / "run", "eval")
    assert final["eval_sim_tau"] > 3, final  # memorised: simulated acceptance far above 1 on its own samples
    return work / "run" / "drafter"


def eval_cli(*args) -> int:
    from dflash_train.cli import main

    # --training-prompts: the overfit drafter is evaluated on the prompts it memorised (that is the point here)
    return main(["eval", "--dtype", "fp32", "--threads", "1", "--max-new-tokens", str(NEW_TOKENS), "--no-warmup",
                 "--training-prompts", *map(str, args)])


@needs_vllm
@pytest.mark.slow
def test_overfit_drafter_in_vllm_is_lossless_accepts_and_agrees_with_the_own_loop(
        overfit_drafter, engine_target, prompts_file, tmp_path):
    """The K sweep in the real engine: a row per K (lossless, tau, both clocks), best_k the fastest with its figures
    as the headline, the engine's speedup agreeing with a stopwatch around the same runs, the concurrency runs, the
    user's engine arguments recorded; and at the whole block the same acceptance as the project's loop."""
    out = tmp_path / "eval"
    # a KV cache with room for every prompt, in blocks shorter than they are: plain decoding's natural pass leaves
    # them all in its prefix cache
    engine_args = json.dumps({"max_num_seqs": 4, "kv_cache_memory_bytes": 64 << 20, "block_size": 32})
    assert eval_cli("--engine", "both", "--drafter", overfit_drafter, "--target", engine_target,
                    "--prompts", prompts_file, "--out", out, "--speculative-tokens", "7,1", "--concurrency", "2",
                    "--engine-args", engine_args, "--ngram", "3,2") == 0
    report = eval_report.load(out)
    vllm, own = report.vllm, report.own
    assert vllm.version == vllm_version()
    assert vllm.environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # on CPU, the engine in the child itself
    assert "each request right after the last (on CPU no idle engine polls)" in vllm.timing.protocol
    rows = {row.k: row for row in vllm.sweep}
    assert sorted(rows) == [1, 7] and vllm.timing.skipped_k == []
    for row in rows.values():
        assert row.lossless_checked == len(PROMPTS) and row.lossless_mismatches == 0, row
        assert row.tokens_unaccounted_by_steps == 0 and len(row.per_position_acceptance) == row.k
        assert len(row.per_prompt) == len(PROMPTS)
        for p in row.per_prompt:  # the decode phase lies in the engine's request time, that in the stopwatch's
            for side in ("plain", "spec"):
                seconds = [getattr(p, f"{side}_{clock}") for clock in ("decode_s", "core_s", "wall_s")]
                assert 0 < seconds[0] < seconds[1] < seconds[2], p
                # both prefill every prompt in full: the plain engine's cache, room for several sequences here,
                # holds them all from its natural pass
                assert getattr(p, f"{side}_cached_tokens") == 0, p
        # both sides decode the same tokens: the engine's speedup and the stopwatch's around the same requests
        # agree, within their noise (the intervals over prompts overlap) and within 10%
        (lo, hi), (wall_lo, wall_hi) = row.speedup_interval, row.speedup_wall_interval
        assert lo <= row.speedup <= hi and wall_lo <= hi and lo <= wall_hi, row
        assert row.speedup == pytest.approx(row.speedup_wall, rel=0.1), row
    best = max(rows.values(), key=lambda row: row.speedup)
    assert vllm.best_k == best.k and (vllm.speedup, vllm.tau_steps) == (best.speedup, best.tau_steps)
    assert vllm.engine_args["speculative_config"] == {"method": "dflash", "model": str(overfit_drafter),
                                                      "num_speculative_tokens": best.k}
    assert vllm.engine_args["max_num_seqs"] == 4 and report.settings.options["engine_args"] == json.loads(engine_args)
    assert vllm.lossless_mismatches == 0 and own.lossless_mismatches == 0
    assert rows[7].tau_steps > 2 and rows[7].per_position_acceptance[0] > 0.5, rows[7]
    assert report.held_out_check["prompts"].training_prompts == len(PROMPTS)  # counted, so push refuses it
    # the engine and the project's loop decode the same prompts with the same drafter and block: the same acceptance
    assert rows[7].tau_steps == pytest.approx(own.tau_steps, rel=SAME_DRAFTS), (rows[7].tau_steps, own.tau_steps)
    # At K = 1 vLLM drafts from the block [anchor, MASK] (vllm/v1/spec_decode/dflash.py: 1 + K query tokens that
    # attend to each other), not from the drafter's [anchor, MASK x 7]: slot 1 sees one mask token where it was
    # trained with seven, and is accepted about half the time, against 0.9 for slot 1 of the whole block (so a
    # fixed bound such as tau > 1.5 fails on some hosts). The project's loop drafts that very block at --block-size
    # 2; a step commits one or two tokens.
    assert eval_cli("--engine", "own", "--drafter", overfit_drafter, "--target", engine_target, "--prompts",
                    prompts_file, "--out", tmp_path / "block-2", "--block-size", "2") == 0
    short = eval_report.load(tmp_path / "block-2").own
    assert 1 <= rows[1].tau_steps <= 2 and short.lossless_mismatches == 0
    assert rows[1].tau_steps == pytest.approx(short.tau_steps, rel=SAME_DRAFTS), (rows[1].tau_steps, short.tau_steps)
    assert vllm.drafter_sha256 == report.drafter.sha256  # the very drafter, weights and config.json
    assert [(r.requests, r.k) for r in vllm.concurrency] == [(1, 1), (1, 7), (2, 1), (2, 7)]
    # vLLM's prompt lookup at both K, timed beside the drafter's first K (7) in the same engine process, on the same
    # prompts at the same lengths, sharing plain decoding's runs: lossless
    looked = {row.k: row for row in vllm.ngram_sweep}
    for k in (2, 3):
        assert [p.plain_core_s for p in looked[k].per_prompt] == [p.plain_core_s for p in rows[7].per_prompt]
    # and that run is the reference, each prompt decoded by plain decoding to its natural stop
    rates = vllm.timing.plain_tokens_per_s_decode
    assert rates["reference"] == pytest.approx(rates["7"]) and rates["reference"] != pytest.approx(rates["1"])
    assert [p.plain_core_s for p in rows[1].per_prompt] != [p.plain_core_s for p in rows[7].per_prompt]
    assert sorted(looked) == [2, 3] and vllm.ngram.k in looked
    for k, lookup in looked.items():
        assert lookup.engine_args["method"] == "ngram" and lookup.engine_args["num_speculative_tokens"] == k
        assert lookup.lossless_checked == len(PROMPTS) and lookup.lossless_mismatches == 0, lookup
        assert 1 <= lookup.tau_steps <= k + 1 and len(lookup.per_position_acceptance) == k, lookup
        assert [(p.id, p.new_tokens) for p in lookup.per_prompt] == \
            [(p.id, p.new_tokens) for p in rows[7].per_prompt]
        assert all(getattr(p, f"{side}_cached_tokens") == 0 for p in lookup.per_prompt for side in ("plain", "spec"))
    # at the drafter's batches
    assert [(r.requests, r.k) for r in vllm.ngram.concurrency] == [(1, 2), (1, 3), (2, 2), (2, 3)]
    assert vllm.serve_command.startswith("vllm serve ") and report.settings.machine.cores >= 1
    md = (out / "report.md").read_text()
    assert "The drafter in the engine and in the project's loop" in md and f"vLLM {vllm_version()}" in md
    assert f"best_k = {best.k}: the fastest at batch 1" in md and "| 3, prompt lookup |" in md
    assert "| 2 | 3, prompt lookup |" in md and "| 2, prompt lookup |" in md
    assert {p.name for p in (out / "engine").iterdir()} == {"timed.log"}  # one engine process


@needs_vllm
@pytest.mark.slow
def test_a_draft_vocabulary_drafts_the_same_in_vllm_as_in_the_own_loop(overfit_drafter, engine_store, engine_target,
                                                                        prompts_file, tmp_path):
    """The format as vLLM reads it: the overfit drafter cut to half the ids its answers use, served by vLLM and by
    the project's loop at the whole block, is lossless in both and accepts the same, less than with its whole head
    (the ids left out cannot be drafted; the whole head's vLLM figures: the test above): vLLM maps each row to the
    same target id as the project's model."""
    from dflash_train.model.checkpoint import create_drafter, draft_vocabulary, load_drafter, save_drafter
    from dflash_train.stages.train.data import StoreSet
    from dflash_train.stages.train.draft_vocab import choose_draft_vocabulary
    from dflash_train.target import checkpoint_stop_token_ids, load_embedding_and_head, load_tokenizer

    stores = StoreSet([str(engine_store)])
    every = list(range(len(stores)))
    used = choose_draft_vocabulary(stores, every, 10 ** 6, [])["answer_ids"]
    vocab = choose_draft_vocabulary(stores, every, used // 2,
                                    checkpoint_stop_token_ids(engine_target, load_tokenizer(str(engine_target))))
    whole, config = load_drafter(overfit_drafter)
    config, rows = draft_vocabulary(config, load_embedding_and_head(str(engine_target))[1], vocab["ids"])
    cut = create_drafter(config)
    cut.load_state_dict({**whole.state_dict(), **rows}, strict=True)
    folder = save_drafter(cut.to(whole.fc.weight.dtype), config, tmp_path / "cut")
    reports = {}
    for name, drafter, engine in (("whole", overfit_drafter, "own"), ("cut", folder, "both")):
        assert eval_cli("--engine", engine, "--drafter", drafter, "--target", engine_target, "--prompts",
                        prompts_file, "--out", tmp_path / f"eval-{name}", "--speculative-tokens", "7") == 0
        reports[name] = eval_report.load(tmp_path / f"eval-{name}")
    (whole_own, cut_own), cut_vllm = (reports[name].own for name in ("whole", "cut")), reports["cut"].vllm
    assert whole_own.lossless_mismatches == cut_own.lossless_mismatches == cut_vllm.lossless_mismatches == 0
    # tokens per verification over all steps: the mean of per-prompt taus moves by a whole prompt's where one near tie
    # flips inside a run of accepted drafts (on a 2-core AMD EPYC with AVX-512 BF16: prompts at 8.0 in the project's
    # loop, 5.75 and 7.67 in vLLM, the other four equal; 4.02 against 3.59 per prompt, 2.25 against 2.19 over all
    # steps), where a row mapped to the wrong target id would draft nothing right
    assert cut_vllm.tau_steps == pytest.approx(cut_own.tau_steps, rel=SAME_DRAFTS), (cut_vllm, cut_own)
    assert cut_own.tau_per_prompt < whole_own.tau_per_prompt - 0.5, (cut_own.tau_per_prompt, whole_own.tau_per_prompt)


CONSTRAINED = [  # one per prompt: what each request of a structured application asks of its answer
    {"guided_regex": "(Yes|No)[a-z ,.]{0,40}"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "poem", "schema": {
        "type": "object", "properties": {"title": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["title", "lines"]}}}},
    {"guided_choice": ["add", "sum", "plus"]},
    {"stop": [" the", "."], "repetition_penalty": 1.3, "min_p": 0.05},
    {"frequency_penalty": 0.5, "logit_bias": {"11": -20}},
    {},
]


@needs_vllm
@pytest.mark.slow
def test_constrained_requests_are_decoded_under_them_losslessly_in_both_engines_beside_lookup_and_suffix(
        overfit_drafter, engine_target, tmp_path):
    """Each held-out request decoded under its own constraint, plain and speculative, in vLLM and the project's loop
    alike (both stop each answer at the same token); what vLLM refuses with speculation (min_p, logit_bias) is left
    out on both sides and counted; suffix decoding, prompt lookup and the combined speculator timed the same way,
    all ranked."""
    from dflash_train.spec_decode.suffix import suffix_problem

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}], **c}) + "\n"
                           for p, c in zip(PROMPTS, CONSTRAINED)))
    out = tmp_path / "eval"
    suffix = [] if suffix_problem() else ["--suffix", "4"]
    assert eval_cli("--engine", "both", "--drafter", overfit_drafter, "--target", engine_target, "--prompts", log,
                    "--out", out, "--speculative-tokens", "7", "--concurrency", "2", "--ngram", "3", *suffix,
                    "--combined", "on") == 0
    report = eval_report.load(out)
    assert report.settings.constraints == ConstraintsSummary(
        constrained=5, of=6, by_kind={"regex": 1, "json_schema": 1, "choice": 1, "settings": 2, "none": 1},
        decoded_without={"min_p": 1, "logit_bias": 1})
    vllm, own = report.vllm, report.own
    assert vllm.lossless_mismatches == 0 and own.lossless_mismatches == 0
    lengths = {p.id: p.new_tokens for p in vllm.per_prompt}
    assert lengths == {p.id: p.new_tokens for p in own.per_prompt}  # the same answers' lengths
    from dflash_train.prompts import load_prompt_records

    from transformers import AutoTokenizer

    ids = [r.id for r in load_prompt_records(log)[0]]
    tok = AutoTokenizer.from_pretrained(engine_target)
    longest = max(len(tok.encode(c, add_special_tokens=False)) for c in CONSTRAINED[2]["guided_choice"])
    assert lengths[ids[2]] <= longest + 1 < NEW_TOKENS  # a choice, then its stop token: far below the cap
    ranked = [r.speculator for r in vllm.ranking]  # with the suffix tree as a source where it loads
    assert sorted(ranked) == sorted(["drafter", "prompt lookup"] + (
        ["suffix decoding", "drafter + suffix + prompt lookup"] if suffix else ["drafter + prompt lookup"]))
    combined = vllm.combined  # the plugin under each request's grammar: lossless, every block counted by source
    assert combined.k == 7 and combined.lossless_mismatches == 0
    assert set(combined.sources) == {"drafter", "lookup"} | ({"suffix"} if suffix else set())
    if suffix:  # before each request the tree held only the answers this engine gave before it
        assert combined.suffix_answers_before == list(range(1, len(combined.per_prompt) + 1))
    assert sum(c.blocks for c in combined.sources.values()) >= len(combined.per_prompt)
    if suffix:
        assert vllm.suffix.k == 4 and vllm.suffix.lossless_mismatches == 0
        assert vllm.suffix.engine_args == {"method": "suffix", "num_speculative_tokens": 4}
    md = (out / "report.md").read_text()
    assert "Constrained traffic: 5 of 6 prompts (83%)" in md and "1 without their min_p" in md


@needs_vllm
@pytest.mark.slow
def test_a_free_limit_times_the_free_speculators_on_the_first_prompts_and_ranks_all_on_those(
        overfit_drafter, engine_target, prompts_file, tmp_path):
    """`--free-limit 2`: prompt lookup and the combined speculator are timed on the first two prompts only, the
    drafter on all; the ranking compares every speculator on those two (the drafter's figure there, not its
    headline over all), and says so."""
    out = tmp_path / "eval"
    assert eval_cli("--engine", "vllm", "--drafter", overfit_drafter, "--target", engine_target, "--prompts",
                    prompts_file, "--out", out, "--speculative-tokens", "7", "--concurrency", "2", "--ngram", "3",
                    "--combined", "k=3,confidence=1", "--free-limit", "2") == 0
    vllm = eval_report.load(out).vllm
    drafted = [p.id for p in vllm.per_prompt]
    assert len(drafted) == len(PROMPTS)
    for free in (vllm.ngram, vllm.combined):
        assert [p.id for p in free.per_prompt] == drafted[:2] and free.lossless_mismatches == 0
    ranked = {r.speculator: r for r in vllm.ranking}
    assert set(ranked) == {"drafter", "prompt lookup", "drafter + prompt lookup"}
    assert {r.prompts for r in ranked.values()} == {2}
    first = vllm.per_prompt[:2]
    on_two = sum(p.plain_core_s for p in first) / sum(p.spec_core_s for p in first)
    assert ranked["drafter"].speedup == pytest.approx(on_two) and vllm.speedup != ranked["drafter"].speedup
    assert ranked["drafter"].tau_per_prompt == pytest.approx(sum(p.tau for p in first) / 2)
    committed = [p.new_tokens - 1 for p in first]  # tau_steps pools the two prompts' steps
    steps = [c / p.tau for c, p in zip(committed, first)]
    assert ranked["drafter"].tau_steps == pytest.approx(sum(committed) / sum(steps))
    assert ranked["prompt lookup"].speedup == vllm.ngram.speedup
    assert ranked["prompt lookup"].tau_steps == vllm.ngram.tau_steps
    assert "each at its own fastest K, on the same 2 prompts:" in (out / "report.md").read_text()


REPEATED = 725  # the engine target's greedy answer to PROMPTS[3] repeats this token five times


@pytest.fixture(scope="module")
def repeating_drafters(engine_target, tmp_path_factory) -> list[Path]:
    """Two tiny drafters of the engine target saved as they ship, in seconds, that draft differently: one that
    drafts REPEATED at every slot (its layers' output projections zeroed, a layer passes its input on: every masked
    slot holds the mask token's embedding, and its final norm's weight turns that into REPEATED's embedding through
    the target's tied LM head), accepted where the target repeats it; and an untrained one (block 3, 2 layers),
    whose drafts the random target accepts nowhere."""
    from test_spec_decode import tiny_drafter

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.target import load_target

    target = load_target(str(engine_target), dtype=torch.float32)
    root, paths = tmp_path_factory.mktemp("drafters"), []
    for name, block, layers, seed in (("repeating", 4, 1, 0), ("untrained", 3, 2, 1)):
        model, config = tiny_drafter(target, block_size=block, num_layers=layers, seed=seed)
        if name == "repeating":
            embeddings = target.model.get_input_embeddings().weight.detach()
            mask = embeddings[config.mask_token_id]
            with torch.no_grad():
                for layer in model.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
                model.norm.weight.copy_(embeddings[REPEATED] / mask)  # the norm's own scale is one factor > 0
        config.target = target.identity().to_dict()
        paths.append(save_drafter(model, config, root / name))
    return paths


@needs_vllm
def test_a_baseline_drafter_is_timed_beside_the_drafter_in_vllm_and_paired_by_prompt(
        repeating_drafters, engine_target, prompts_file, tmp_path):
    """`--baseline-drafter` in vLLM: the baseline drafter timed at the drafter's K on plain decoding's same runs,
    its row in the report (per prompt, lossless), the drafter there against it paired by prompt (paired_against's
    rule: the ratios of the summed per-prompt taus and of the speedups' sums), its sha256, its place in the ranking
    and report.md's lines."""
    from dflash_train.model.checkpoint import drafter_identity

    repeating, untrained = repeating_drafters
    out = tmp_path / "eval"
    assert eval_cli("--engine", "vllm", "--drafter", repeating, "--baseline-drafter", untrained, "--target",
                    engine_target, "--prompts", prompts_file, "--out", out, "--limit", "4", "--speculative-tokens",
                    "2", "--concurrency", "2") == 0
    vllm = eval_report.load(out).vllm
    (mine,), base, against = vllm.sweep, vllm.baseline, vllm.against_baseline
    assert base.k == mine.k == against.k == 2
    assert base.engine_args == {"method": "dflash", "model": str(untrained), "num_speculative_tokens": 2}
    assert vllm.baseline_sha256 == drafter_identity(untrained)["sha256"] != vllm.drafter_sha256
    assert [p.id for p in base.per_prompt] == [p.id for p in mine.per_prompt] and len(mine.per_prompt) == 4
    for row in (mine, base):  # lossless, over every prompt
        assert row.lossless_checked == 4 and row.lossless_mismatches == 0
    assert [p.plain_core_s for p in base.per_prompt] == [p.plain_core_s for p in mine.per_prompt]  # shared runs
    assert {p.tau for p in base.per_prompt} == {1.0} and max(p.tau for p in mine.per_prompt) > 1  # REPEATED
    assert against.prompts == 4
    assert against.tau_ratio == pytest.approx(sum(p.tau for p in mine.per_prompt) / sum(p.tau for p in base.per_prompt))
    speedup = [sum(p.plain_core_s for p in row.per_prompt) / sum(p.spec_core_s for p in row.per_prompt)
               for row in (mine, base)]
    assert against.speedup_ratio == pytest.approx(speedup[0] / speedup[1])
    assert {r.speculator: r.k for r in vllm.ranking} == {"drafter": 2, "baseline drafter": 2}
    assert "baseline drafter 2" in vllm.timing.plain_tokens_per_s_decode
    md = (out / "report.md").read_text()
    assert "| 2, baseline drafter |" in md
    assert f"the drafter against it at K = 2, paired by prompt: τ per prompt {fmt(against.tau_ratio)} [" in md


@needs_vllm
@pytest.mark.slow
def test_the_lossless_check_alone_decodes_each_prompt_plain_and_speculative_to_its_stop(overfit_drafter,
                                                                                       engine_target, tmp_path):
    """The eval's fp32 rerun of its mismatches (`check` mode): per prompt the plain output to its natural stop and
    the speculative one at the one K asked, untimed; the overfit drafter's equal the plain ones token for token."""
    from dflash_train.engine.jobs import EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine
    from dflash_train.target import load_tokenizer, render_prompt

    tokenizer = load_tokenizer(str(engine_target))
    requests = [EngineRequest(id=f"p{i}", prompt_token_ids=render_prompt(tokenizer, [{"role": "user", "content": p}]),
                              max_tokens=NEW_TOKENS) for i, p in enumerate(PROMPTS[:3])]
    job = EngineJob(target=str(engine_target), requests=requests, stop_token_ids=[tokenizer.eos_token_id],
                    drafter=str(overfit_drafter), max_model_len=256, mode="check", speculative_tokens=[5])
    assert job.max_num_seqs() == 1  # one request at a time, as the timed runs it rechecks
    result = run_engine(job, tmp_path, "the lossless check")
    (run,) = result.timed["runs"]
    assert run["k"] == 5 and run["llm_kwargs"]["speculative_config"]["num_speculative_tokens"] == 5
    assert "batch1" not in run  # nothing timed
    plain = result.by_id()
    assert [o["id"] for o in run["outputs"]] == list(plain) == ["p0", "p1", "p2"]
    for o in run["outputs"]:
        assert 0 < len(o["token_ids"]) <= NEW_TOKENS and o["token_ids"] == plain[o["id"]].token_ids


@needs_vllm
@pytest.mark.slow
def test_a_drafter_the_engine_rejects_is_one_line_and_writes_nothing(overfit_drafter, engine_target, prompts_file,
                                                                     tmp_path, capsys, monkeypatch):
    """Mixed sliding/full attention layers (a config our loader reads as all full attention) are refused by this
    vLLM's model runner. The engine's log named in the line is kept (in the temporary folder, here tmp_path's)."""
    import shutil
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    bad = tmp_path / "bad"
    shutil.copytree(overfit_drafter, bad)
    config = json.loads((bad / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    config["sliding_window"] = 8
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    rc = eval_cli("--engine", "vllm", "--drafter", bad, "--target", engine_target, "--prompts", prompts_file,
                  "--limit", "1", "--out", out)
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(err) == 1 and err[0].startswith("dflash-train eval: error: vLLM with drafter"), err
    assert str(bad) in err[0] and "the vLLM engine exited with 1" in err[0] and "full log:" in err[0], err
    assert "mixed sliding/full" in err[0]  # the engine's own reason
    assert not out.exists()
    log = Path(err[0].rsplit("full log: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.is_relative_to(tmp_path) and log.parent.parent.name.startswith("dflash-eval-engine-")


def test_missing_vllm_is_one_line_naming_the_install(tmp_path, prompts_file):
    """An interpreter where vLLM cannot be imported: eval and capture say how to get it, before loading anything."""
    hide = ("import json, sys; sys.modules['vllm'] = None  # as if it were not installed: import vllm fails\n"
            "from dflash_train.cli import main\n"
            "for args in json.loads(sys.argv[1]):  # both commands in one interpreter: its start is most of the cost\n"
            "    print(f'exit {main(args)}', file=sys.stderr)\n")
    commands = [["eval", "--drafter", str(tmp_path), "--prompts", str(prompts_file), "--out", str(tmp_path / "e")],
                ["capture", "--engine", "vllm", "--prompts", str(prompts_file), "--out", str(tmp_path / "s")]]
    proc = subprocess.run([sys.executable, "-c", hide, json.dumps(commands)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    exits = [i for i, line in enumerate(lines) if line.startswith("exit ")]
    assert [lines[i] for i in exits] == ["exit 2", "exit 2"], proc.stderr[-2000:]
    for i in exits:  # each command's last line before its exit: the one error line
        assert "vLLM is not installed" in lines[i - 1] and "make install" in lines[i - 1], proc.stderr[-2000:]
        assert lines[i - 1].startswith("dflash-train eval: error:" if i == exits[0] else "dflash-train capture: error:")
    assert not (tmp_path / "e").exists() and not (tmp_path / "s").exists()


# --engine-args an adversarial user might pass, and what each must get: the key, and the words of its refusal
REFUSED_ENGINE_ARGS = [
    ({"trust_remote_code": True}, "has 'trust_remote_code', which dflash-train does not pass to vLLM"),
    ({"download_dir": "/tmp/elsewhere"}, "has 'download_dir', which dflash-train does not pass to vLLM"),
    ({"tokenizer": "/home/me/other"}, "has 'tokenizer', which dflash-train does not pass to vLLM"),
    ({"worker_extension_cls": "os.system"}, "has 'worker_extension_cls', which dflash-train does not pass to vLLM"),
    ({"kv_cache_memory_bytes": -1}, "has kv_cache_memory_bytes=-1, which must be an integer >= 1"),
    ({"max_model_len": -1}, "sets 'max_model_len', which dflash-train sets itself"),
    ({"max_num_seqs": -4}, "has max_num_seqs=-4, which must be an integer >= 1"),
    ({"tensor_parallel_size": 0}, "has tensor_parallel_size=0, which must be an integer >= 1"),
    ({"gpu_memory_utilization": 7}, "has gpu_memory_utilization=7, which must be in (0, 1]"),
    ({"max_num_seqs": "8"}, 'has max_num_seqs="8", which must be an integer >= 1'),
    ({"enforce_eager": 1}, "has enforce_eager=1, which must be true or false"),
    ({"tensor_paralel_size": 8}, "has 'tensor_paralel_size', which dflash-train does not pass to vLLM (did you "
                                 "mean 'tensor_parallel_size'?)"),
    ({"dtype": "half"}, "sets 'dtype', which dflash-train sets itself (use --dtype)"),
]


def test_engine_args_outside_the_allow_list_or_their_range_are_one_line_before_any_engine_or_folder(
        tmp_path, prompts_file, capsys):
    """Code-loading and path keys, keys the project sets, unknown keys and values out of vLLM's ranges: one line
    naming --engine-args and the key, exit 2, in eval and capture alike, before any engine starts (none is
    installed-checked, let alone started: the option check runs first) and before the output folder exists."""
    from dflash_train.cli import main

    for args, words in REFUSED_ENGINE_ARGS:
        for stage in (["eval", "--drafter", str(tmp_path)], ["capture", "--engine", "vllm"]):
            out = tmp_path / stage[0]
            rc = main([*stage, "--prompts", str(prompts_file), "--out", str(out), "--engine-args", json.dumps(args)])
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert rc == 2 and len(err) == 1, (args, err)
            assert err[0].startswith(f"dflash-train {stage[0]}: error: --engine-args {args!r} {words}"), err
            assert not out.exists()


@needs_vllm
def test_the_engine_args_ranges_are_vllms_own_and_what_they_allow_passes():
    """Each allowed key is a vLLM engine argument, its range refuses what vLLM's config class refuses (the value
    just past each bound it states), and the names a key takes are vLLM's own."""
    import annotated_types
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    from dflash_train.engine.args import ENGINE_ARGS, engine_args_problem

    assert set(ENGINE_ARGS) <= set(EngineArgs.__dataclass_fields__)
    owners = {ParallelConfig: ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"],
              CacheConfig: ["gpu_memory_utilization", "kv_cache_memory_bytes", "block_size"],
              SchedulerConfig: ["max_num_seqs", "max_num_batched_tokens"]}
    bounded = 0
    for owner, keys in owners.items():
        for key in keys:
            for bound in owner.__pydantic_fields__[key].metadata:  # annotated_types' Ge, Gt, Le, Lt
                edge = next(getattr(bound, name) for name in ("ge", "gt", "le", "lt") if hasattr(bound, name))
                past = {annotated_types.Ge: edge - 1, annotated_types.Le: edge * 1.001}.get(type(bound), edge)
                assert engine_args_problem({key: past}) is not None, (key, bound)
                if isinstance(bound, (annotated_types.Ge, annotated_types.Le)):  # the edge itself is vLLM's
                    assert engine_args_problem({key: edge}) is None, (key, bound)
                bounded += 1
    assert bounded == 8  # every bound vLLM states for these keys was tried
    assert engine_args_problem({"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "data_parallel_size": 2,
                                "gpu_memory_utilization": 1.0, "kv_cache_memory_bytes": 64 << 20, "block_size": 32,
                                "kv_cache_dtype": "fp8", "enable_prefix_caching": False, "max_num_seqs": 1,
                                "max_num_batched_tokens": 4096, "enable_chunked_prefill": True,
                                "enforce_eager": False, "quantization": "fp8"}) is None
    assert engine_args_problem({"quantization": "fp9"}).startswith('has quantization="fp9", which must be one of awq')
    assert engine_args_problem({"kv_cache_dtype": "fp9"}).startswith('has kv_cache_dtype="fp9", which must be one of')


def engine_pid_of(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """The pid of the vLLM engine process that `proc` (an eval or a capture) started, once it has started."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        found = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "dflash_train.engine.child"], capture_output=True,
                               text=True).stdout.split()
        if found:
            return int(found[0])
        time.sleep(0.2)
    raise AssertionError("the engine process never started")


@needs_vllm
@pytest.mark.slow
def test_an_engine_that_dies_is_one_line_and_leaves_no_report(overfit_drafter, engine_target, prompts_file, tmp_path):
    out = tmp_path / "eval"
    command = [sys.executable, "-m", "dflash_train", "eval", "--engine", "vllm", "--dtype", "fp32", "--drafter",
               str(overfit_drafter), "--target", str(engine_target), "--prompts", str(prompts_file), "--out",
               str(out), "--limit", "1", "--training-prompts"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    os.kill(engine_pid_of(proc), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and "the vLLM engine was killed by signal 9" in lines[-1], err[-2000:]
    assert not out.exists()
    log = Path(lines[-1].rsplit("full log: ", 1)[1].rstrip(")"))  # kept for the failure report, in TMPDIR
    assert log.is_file() and log.is_relative_to(tmp_path)


def untrained_eval_command(engine_target, prompts_file, tmp_path: Path, *extra: str) -> tuple[list[str], Path, Path]:
    """`dflash-train eval` in vLLM of one prompt with an untrained tiny drafter (a test stops it while its engine
    runs, before it drafts), and its scratch folder (made: the eval's TMPDIR) and output folder."""
    from test_spec_decode import tiny_drafter

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.target import load_target

    target = load_target(str(engine_target), dtype=torch.float32)
    model, config = tiny_drafter(target, block_size=4)
    config.target = target.identity().to_dict()
    drafter = save_drafter(model, config, tmp_path / "drafter")
    scratch, out = tmp_path / "tmp", tmp_path / "eval"
    scratch.mkdir()
    return ([sys.executable, "-m", "dflash_train", "eval", "--engine", "vllm", "--dtype", "fp32", "--drafter",
             str(drafter), "--target", str(engine_target), "--prompts", str(prompts_file), "--out", str(out),
             "--limit", "1", *extra], scratch, out)


def marked_incomplete(out: Path) -> bool:
    """Whether `out` is an eval's folder marked INCOMPLETE, holding nothing but what an eval writes while it runs."""
    from dflash_train.provenance import INCOMPLETE_MARKER, LOCK_FILE, stage_of
    from dflash_train.stages.evaluate.command import ENGINE_RUNS

    return ((out / INCOMPLETE_MARKER).is_file() and stage_of(out) == "eval"
            and {p.name for p in out.iterdir()} <= {LOCK_FILE, INCOMPLETE_MARKER, ENGINE_RUNS})


def rerun_completes(command: list[str], env: dict[str, str], out: Path) -> None:
    """The same eval command again: it clears the INCOMPLETE mark and writes the whole report, nothing left over."""
    from dflash_train.provenance import INCOMPLETE_MARKER, is_complete
    from dflash_train.stages.evaluate.command import ENGINE_RUNS

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert is_complete(out) and not (out / INCOMPLETE_MARKER).exists()
    assert eval_report.load(out).vllm and not (out / ENGINE_RUNS).exists()


@needs_vllm
@pytest.mark.slow
def test_ctrl_c_while_the_engine_runs_is_one_line_and_leaves_the_folder_marked_incomplete(engine_target, prompts_file,
                                                                                          tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once the engine is running: exit 130,
    one line, no traceback; the eval folder is left marked INCOMPLETE (it used to be removed), with no scratch folder
    of engine runs in it or in the temporary folder (an eval used to leave a dflash-eval-engine-* folder there
    whenever it ended after an engine ran); the same command run again completes it. Before that, while it decodes,
    the same command into its folder stops at once (README: every stage locks its folder while it writes), in one
    line naming the first run (its pid), exit 2, and leaves it decoding."""
    import socket

    from dflash_train.stages.evaluate.command import ENGINE_RUNS

    command, scratch, out = untrained_eval_command(engine_target, prompts_file, tmp_path, "--max-new-tokens", "8")
    env = dict(os.environ, TMPDIR=str(scratch))
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, preexec_fn=default_sigint)
    engine = engine_pid_of(proc)
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    last = second.stderr.strip().splitlines()[-1]
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert last.startswith(f"dflash-train eval: error: {out} is being written by another run right now (eval, "
                           f"pid {proc.pid} on {socket.gethostname()} since "), last
    assert last.endswith("): two runs into one folder would mix their outputs. Wait for it to finish or choose "
                         "another folder")
    assert proc.poll() is None and Path(f"/proc/{engine}").exists()  # the first still decodes
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == 130 and lines[-1] == (
        "dflash-train eval: interrupted: the folder stays marked INCOMPLETE (an eval completes it only once every run "
        "has finished); rerun the same command to evaluate again"), err[-3000:]
    assert marked_incomplete(out) and not (out / ENGINE_RUNS).exists() and not list(scratch.iterdir())
    rerun_completes(command, env, out)


@needs_vllm
@pytest.mark.slow
def test_a_request_either_engine_refuses_is_left_out_of_both_sides_of_the_lossless_check(engine_target, tmp_path):
    """The lossless check alone (`check` mode) of three requests: one under a regex no engine compiles, one sampled
    under min_p, which vLLM takes without speculation and refuses with it; both are left out of plain decoding and
    of the speculative side alike, each named with its reason, and the third is decoded by both."""
    from test_spec_decode import tiny_drafter

    from dflash_train.engine.jobs import EngineJob, EngineRequest
    from dflash_train.engine.runner import run_engine
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.target import load_target

    target = load_target(str(engine_target), dtype=torch.float32)
    model, config = tiny_drafter(target, block_size=4)  # untrained: what it drafts does not matter here
    config.target = target.identity().to_dict()
    drafter = save_drafter(model, config, tmp_path / "drafter")
    prompt = target.render([{"role": "user", "content": PROMPTS[0]}])
    constraints = {"p0": None, "p1": {"structured": {"kind": "regex", "spec": "(?=a)a+"}}, "p2": {"min_p": 0.1}}
    requests = [EngineRequest(id=rid, prompt_token_ids=prompt, max_tokens=6, constraints=c, seed=1,
                              temperature=0.5 if rid == "p2" else 0.0)  # greedy, vLLM would drop min_p
                for rid, c in constraints.items()]
    job = EngineJob(target=str(engine_target), requests=requests, stop_token_ids=target.stop_token_ids(),
                    drafter=str(drafter), max_model_len=256, mode="check", speculative_tokens=[2])
    result = run_engine(job, tmp_path / "engine", "the lossless check")
    assert sorted(result.refused) == ["p1", "p2"]
    assert result.refused["p1"].startswith("VLLMValidationError: ") and "regex" in result.refused["p1"]
    assert result.refused["p2"] == ("VLLMValidationError: The min_p and logit_bias sampling parameters are not yet "
                                    "supported with speculative decoding.")
    (run,) = result.timed["runs"]
    assert list(result.by_id()) == [o["id"] for o in run["outputs"]] == ["p0"]


# a constraint the engine refuses when the request is added, though ingest takes it (Python's re compiles it): the
# grammar backend reads no lookahead
UNCOMPILABLE = {"structured_outputs": {"regex": "(?=a)a+"}}


def log_with_one_refused(path: Path, texts: list[str], refused_at: int) -> Path:
    """A log of one request per text, the one at `refused_at` under UNCOMPILABLE."""
    path.write_text("".join(json.dumps({"request": {"messages": [{"role": "user", "content": text}],
                                                    **(UNCOMPILABLE if i == refused_at else {})}}) + "\n"
                            for i, text in enumerate(texts)))
    return path


def ids_by_text(log: Path) -> dict[str, str]:
    from dflash_train.prompts import load_prompt_records

    return {r.messages[0]["content"]: r.id for r in load_prompt_records(log)[0]}


@needs_vllm
@pytest.mark.slow
def test_a_request_the_engine_refuses_is_dropped_with_its_reason_and_every_other_answer_is_stored(
        engine_target, tmp_path, capsys):
    """`capture --engine vllm` of a log where vLLM refuses one request (a regex its grammar backend cannot compile):
    the other answers are all stored, the refused one is named with the engine's reason in the manifest and on the
    output, exit 0; and the refusal is kept beside the generated answers, so that a resumed capture does not ask
    the engine again."""
    from dflash_train.store.reader import open_store
    from dflash_train.store.verify import verify_store

    texts = PROMPTS[:4] + ["Say a few a's."]
    log = log_with_one_refused(tmp_path / "log.jsonl", texts, refused_at=4)
    ids = ids_by_text(log)
    out = tmp_path / "store"
    assert capture_cli("--engine", "vllm", "--prompts", log, "--target", engine_target, "--out", out,
                       "--storage", "none") == 0
    store = open_store(out)
    refused = ids[texts[4]]
    assert sorted(store.ids) == sorted(ids[t] for t in texts[:4]) and verify_store(out) == []
    assert store.manifest["dropped"] == {"refused_by_engine": 1}
    assert store.manifest["dropped_ids"] == {"refused_by_engine": [refused]}
    why = store.manifest["dropped_why"][refused]
    assert why.startswith("VLLMValidationError: ") and "regex" in why and "\n" not in why, why
    printed = capsys.readouterr().out
    assert f"vLLM refused 1 request(s), left out of the store: {refused}: {why}" in printed
    rows = [json.loads(line) for line in (out / "engine-responses.jsonl").read_text().splitlines()]
    assert {"id": refused, "refused": why} in rows and len(rows) == len(texts)


@needs_vllm
@pytest.mark.slow
def test_a_prompt_the_engine_refuses_is_left_out_of_every_comparison_and_named_in_the_report(
        engine_target, tmp_path, capsys):
    """`eval --engine both` where vLLM refuses one prompt: plain decoding and the drafter both decode only the
    others (paired by prompt), and so does the project's loop (whose grammar backend cannot read that prompt's
    regex either: it stopped the eval with a RuntimeError); the report names the refused one with the engine's
    reason (vLLM's refused_by_engine), and the project's loop's section says it did not decode it; where vLLM
    refuses every prompt, one line, exit 2, no folder."""
    from test_spec_decode import tiny_drafter

    from dflash_train.cli import main
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.target import load_target

    target = load_target(str(engine_target), dtype=torch.float32)
    model, config = tiny_drafter(target, block_size=4)  # untrained: what it drafts does not matter here
    config.target = target.identity().to_dict()
    drafter = save_drafter(model, config, tmp_path / "drafter")
    texts = PROMPTS[:2] + ["Say a few a's."]
    log = log_with_one_refused(tmp_path / "log.jsonl", texts, refused_at=1)
    ids = ids_by_text(log)

    def eval_of(prompts: Path, out: Path) -> int:
        return main(["eval", "--engine", "both", "--dtype", "fp32", "--threads", "1", "--drafter", str(drafter),
                     "--target", str(engine_target), "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "6", "--speculative-tokens", "2", "--concurrency", "2"])

    assert eval_of(log, tmp_path / "eval") == 0
    report = eval_report.load(tmp_path / "eval")
    vllm, own = report.vllm, report.own
    refused, kept = ids[texts[1]], sorted(ids[t] for t in (texts[0], texts[2]))
    (why,) = vllm.refused_by_engine.values()
    assert list(vllm.refused_by_engine) == [refused] and why.startswith("VLLMValidationError: "), why
    (row,) = vllm.sweep
    assert sorted(p.id for p in row.per_prompt) == kept and row.lossless_checked == 2
    assert sorted(p.id for p in own.per_prompt) == kept and own.lossless_checked == 2
    assert report.settings.own_prompts == 2
    md = (tmp_path / "eval" / "report.md").read_text()
    assert f"- {refused}: {why}" in md
    assert f"Not decoded here: the 1 prompt(s) vLLM refused ({refused}; its reasons above)" in md
    assert f"vLLM refused 1 prompt(s), left out of every comparison: {refused}: {why}" in capsys.readouterr().out

    only = log_with_one_refused(tmp_path / "only.jsonl", [texts[1]], refused_at=0)
    assert eval_of(only, tmp_path / "none") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("dflash-train eval: error: ") and "vLLM refused all 1 prompts" in err[0]
    assert "nothing to evaluate" in err[0], err
    assert not (tmp_path / "none").exists()


def _gone(pid: int, timeout_s: float = 60) -> bool:
    """Whether process `pid` has exited (or is a zombie nobody reaped) within `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_eval_killed_while_its_engine_runs_leaves_no_engine_nor_scratch_and_its_rerun_completes(
        engine_target, prompts_file, tmp_path, sig):
    """`kill` (or `kill -9`) of the eval alone, once its engine runs: the engine stops with it, nothing is left but
    the eval folder, marked INCOMPLETE (it was left unmarked) and holding no report (at most its engine runs, which
    the rerun removes); the eval used to leave its scratch folder of engine runs in the temporary folder. The same
    command run again after `kill -9` clears the mark and writes the whole report."""
    command, scratch, out = untrained_eval_command(engine_target, prompts_file, tmp_path, "--max-new-tokens", "8",
                                                   "--training-prompts")
    env = dict(os.environ, TMPDIR=str(scratch))
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    engine = engine_pid_of(proc)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and _gone(engine), err[-3000:]
    assert marked_incomplete(out) and not list(scratch.iterdir())  # nothing in the temporary folder
    if sig == signal.SIGKILL:  # the harder leftover (SIGTERM's is Ctrl-C's, whose test reruns it)
        rerun_completes(command, env, out)
        assert not list(scratch.iterdir())


# --- the states recorded in vLLM's own forwards (engine.taps) -----------------------------------------------------

ROUTER = "You route messages. Answer in JSON with the keys intent and summary, nothing else. " * 3


def recorded_job(target, folder: Path, dtype: str, **engine_args):
    """Requests sharing a long system prompt (vLLM's prefix cache serves it: in the step that computes it and after
    the request that computed it finished and was written), answers of different lengths, one under a JSON grammar,
    one ended by a stop string; decoded 2 at a time."""
    from dflash_train.engine.jobs import EngineJob, EngineRequest

    prompts = [target.render([{"role": "system", "content": ROUTER}, {"role": "user", "content": p}]) for p in PROMPTS]
    prompts.append(target.render([{"role": "user", "content": "Hello there."}]))
    constraints = {1: {"structured": {"kind": "json_object", "spec": None}}, 2: {"stop": [". ", "e"]}}
    requests = [EngineRequest(id=f"p{i}", prompt_token_ids=p, max_tokens=NEW_TOKENS - 2 * i,
                              constraints=constraints.get(i)) for i, p in enumerate(prompts)]
    return EngineJob(target=str(target.path), requests=requests, stop_token_ids=target.stop_token_ids(), dtype=dtype,
                     max_model_len=max(map(len, prompts)) + NEW_TOKENS + 1, mode="batch", states_to=str(folder),
                     state_layers=LAYERS, state_topk=4, engine_args={"max_num_seqs": 2, **engine_args})


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_states_and_topk_vllm_records_are_those_of_a_prefill_over_prompt_and_answer(engine_target, tmp_path,
                                                                                        dtype):
    """Every position's tapped states (prompt, answer and the final token, which vLLM never feeds back) and top-k,
    recorded in the forwards that generated the answer, equal `prefill_capture`'s over prompt + answer (fp32:
    rounding; bf16: the bf16 bound of tests/tolerance.py), the positions the prefix cache served included."""
    from dflash_train.engine.runner import run_engine
    from dflash_train.engine.taps import read_states, states_file
    from dflash_train.states import prefill_capture
    from dflash_train.target import load_target
    from tolerance import model_tolerance

    target = load_target(str(engine_target), dtype=getattr(torch, dtype))
    job = recorded_job(target, tmp_path / "states", dtype)
    result = run_engine(job, tmp_path, "recorded states")
    log = (tmp_path / "engine.log").read_text(errors="replace")
    cached = int(log.split("states: ")[1].split(" positions taken")[0].split(", ")[1])
    assert cached >= 5 * 64  # the shared system prompt, served from the cache to most requests
    assert {o.finish_reason for o in result.outputs} >= {"stop", "length"}
    for request, output in zip(job.requests, result.outputs):
        got = read_states(states_file(tmp_path / "states", request.id))
        sequence = request.prompt_token_ids + output.token_ids
        assert got["input_ids"].tolist() == sequence
        ref = prefill_capture(target.model, [sequence], [len(request.prompt_token_ids)], LAYERS,
                              target.tokenizer.pad_token_id, topk=4)[0]
        assert got["hidden_states"].dtype == ref.hidden_states.dtype
        assert got["hidden_states"].shape == ref.hidden_states.shape  # a row for every position
        scale = ref.hidden_states.float().abs().max()
        if dtype == "float32":
            tol = 2e-4 * float(scale)
            assert torch.equal(got["topk_ids"][:-1], ref.topk_ids)
        else:
            tol = model_tolerance(target.config, ref.hidden_states.float(), torch.bfloat16)
        assert float((got["hidden_states"].float() - ref.hidden_states.float()).abs().max()) < tol
        assert got["topk_logprobs"][0].isinf().all() and got["topk_ids"][0].eq(0).all()
        logp = ref.topk_logprobs[1:]
        # the top-k log-probs: close for fp32; for bf16 the log-prob of the reference's tokens under the recorded
        # distribution is not compared (other tokens may enter the top-k): the best one's log-prob is
        bound = 1e-3 if dtype == "float32" else model_tolerance(target.config, logp, torch.bfloat16)
        assert float((got["topk_logprobs"][1:-1, 0] - logp[:, 0]).abs().max()) < bound


@needs_vllm
@pytest.mark.slow
def test_a_killed_engine_capture_regenerates_only_the_answers_whose_states_it_lost(engine_target, prompts_file,
                                                                                    engine_store, tmp_path,
                                                                                    monkeypatch, capsys):
    """A capture killed after the engine streamed every answer and its states, while the store was written: the
    rerun keeps the answers whose states files are there, generates again those it lost (a states file, a streamed
    line), never those stored, and stores what an uninterrupted capture stores; the states files go at the end.
    --store-topk: every position's top-k as `prefill_capture` computes it (fp32), kept and regenerated answers alike,
    one row per token (the row past the final token the engine also records is not stored)."""
    from dflash_train.engine.taps import states_file
    from dflash_train.stages.capture.responses import ENGINE_RESPONSES, engine_states_folder
    from dflash_train.states import prefill_capture
    from dflash_train.store.reader import open_store
    from dflash_train.store.writer import StoreWriter
    from dflash_train.target import load_target

    out = tmp_path / "killed"
    add, calls = StoreWriter.add, []

    def killed(self, *args, **kwargs):
        calls.append(kwargs["id"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return add(self, *args, **kwargs)

    monkeypatch.setattr(StoreWriter, "add", killed)
    args = ("--engine", "vllm", "--prompts", prompts_file, "--target", engine_target, "--out", out, "--batch-size", 2,
            "--shard-size-mb", 0.01, "--store-topk", 4)  # a shard closes after each batch
    assert capture_cli(*args) != 0
    monkeypatch.setattr(StoreWriter, "add", add)
    stored = [i for shard in json.loads((out / "journal-r000.json").read_text())["shards"] for i in shard["ids"]]
    assert stored == calls[:2]
    unstored = [rid for rid in (json.loads(ln)["id"] for ln in
                                                   (out / ENGINE_RESPONSES).read_text().splitlines())
                                   if rid not in calls[:2]]
    folder = engine_states_folder(out)
    states_file(folder, stored[0]).unlink()  # stored: not needed
    states_file(folder, unstored[0]).unlink()  # lost: generated again
    lines = [ln for ln in (out / ENGINE_RESPONSES).read_text().splitlines() if json.loads(ln)["id"] != unstored[1]]
    (out / ENGINE_RESPONSES).write_text("".join(ln + "\n" for ln in lines))  # its line lost: generated again
    capsys.readouterr()
    assert capture_cli(*args) == 0
    said = capsys.readouterr().out
    assert f"vLLM generates 2 responses ({len(PROMPTS) - 2} kept from an earlier run)" in said
    assert not folder.exists()
    reference = {s["id"]: s for s in open_store(engine_store)}
    resumed = open_store(out)
    assert sorted(resumed.ids) == sorted(reference)
    target = load_target(str(engine_target), dtype=torch.float32)
    for sample in resumed:
        ref = reference[sample["id"]]
        assert sample["input_ids"].tolist() == ref["input_ids"].tolist()
        torch.testing.assert_close(sample["hidden_states"], ref["hidden_states"], rtol=1.6e-2, atol=1e-2)
        ids = sample["input_ids"].tolist()
        prefill = prefill_capture(target.model, [ids], [int((~sample["loss_mask"]).sum())], LAYERS,
                                  target.tokenizer.pad_token_id, topk=4)[0]
        assert torch.equal(sample["topk_ids"].int(), prefill.topk_ids)
        torch.testing.assert_close(sample["topk_logprobs"].float(), prefill.topk_logprobs, rtol=0, atol=2e-2)
