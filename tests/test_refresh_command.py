"""`dflash-train refresh` (dflash_train/refresh/command.py) on real logs, the tiny target and a tiny serving drafter:
each round ingests only the prompts no earlier round took, through ingest's own command, and records them; a whole
round measures the serving drafter's drift, captures, trains a candidate warm-started from it and judges it against
the serving drafter side by side in vLLM; the same logs again make no second round, and a round stopped or killed
during or after any stage reruns to the same ledger."""

import argparse
import contextlib
import dataclasses
import io
import json

import pytest

from dflash_train.cli import main as cli_main
from dflash_train.prompts import SEEN_IDS_FILE, read_ids
from dflash_train.provenance import start_output
from dflash_train.refresh.rounds import LEDGER_FILE, load

QUESTIONS = [f"question number {i}: how far is town {i} from the coast?" for i in range(50)]


@pytest.fixture(scope="module")
def engine_target(tmp_path_factory):
    """The tiny random Llama with head_dim 32: vLLM (a round's capture and evals) runs it on CPU."""
    from tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("engine_target"), num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def serving(tmp_path_factory, engine_target):
    """A tiny drafter folder for the tiny target: the drafter serving now. It reads layers 1, 3 and 5, not the five
    that capture taps by default: a round must tap the serving drafter's."""
    from tiny import make_tiny_drafter
    from transformers import AutoConfig, AutoTokenizer

    from dflash_train.model.checkpoint import save_drafter

    config, tokenizer = AutoConfig.from_pretrained(engine_target), AutoTokenizer.from_pretrained(engine_target)
    model, dconfig = make_tiny_drafter(config, tokenizer, target_layer_ids=[1, 3, 5])
    return save_drafter(model, dconfig, tmp_path_factory.mktemp("serving") / "app-dflash")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, engine_target):
    """The options that run a round on the tiny target: a recipe of two training steps, short answers."""
    import yaml

    from conftest import REPO_ROOT

    recipe = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "refresh-test", "output_dir": "runs/unused", "seed": 0,
        "data": {"max_length": 256}, "drafter": {"block_size": 4}, "objective": {"num_anchors": 8},
        "train": {"max_steps": 2, "micro_batch_size": 2, "device": "cpu", "cpu_threads": 1,
                  "deepspeed": str(REPO_ROOT / "recipes" / "deepspeed" / "zero2.json")},
        "checkpoint": {"every": 1000}, "eval": {"every": 0, "at_end": False}, "push": {"min_tau": 1.0},
        "logging": {"progress_bar": False, "wandb_mode": "disabled"}}))
    return ["--target", str(engine_target), "--recipe", str(recipe), "--max-new-tokens", "8", "--capture-limit",
            "6", "--batch-size", "6"]


def write_log(path, texts):
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def refresh_argv(logs, out, serving, tiny, *extra):
    return ["refresh", *map(str, logs), "--out", str(out), "--serving", str(serving), "--eval-fraction", "0.2",
            "--max-prompt-tokens", "0", "--no-push", *tiny, *extra]


def ingest_argv(logs, out, serving, tiny, *extra):
    """A round up to its ingest: what the ledger's tests need."""
    return refresh_argv(logs, out, serving, tiny, "--until", "ingest", *extra)


def ledger_text(out):
    return (out / LEDGER_FILE).read_text()


def test_rounds_ingest_only_new_prompts_and_the_same_logs_make_no_second_round(tmp_path, serving, tiny, capsys):
    out = tmp_path / "refresh"
    day1 = write_log(tmp_path / "day1.jsonl", QUESTIONS[:30])
    assert cli_main(ingest_argv([day1], out, serving, tiny)) == 0
    printed = capsys.readouterr().out
    assert "refresh: round-001" in printed and "30 new prompt(s)" in printed and "0 seen in earlier rounds" in printed
    (one,) = load(out).rounds
    assert len(one.train) + len(one.eval) == 30 and one.serving["name"] == "app-dflash"
    assert one.serving["weights_sha256"] and str(tmp_path) not in ledger_text(out)

    ledger_before = ledger_text(out)
    provenance = (out / "round-001" / "prompts" / "provenance.json").read_bytes()
    moved = write_log(tmp_path / "elsewhere.jsonl", QUESTIONS[:30])  # the same bytes under another name
    assert cli_main(ingest_argv([moved], out, serving, tiny)) == 0
    assert "is complete and recorded in the ledger, skipping" in capsys.readouterr().out
    assert ledger_text(out) == ledger_before
    assert (out / "round-001" / "prompts" / "provenance.json").read_bytes() == provenance

    day2 = write_log(tmp_path / "day2.jsonl", QUESTIONS[20:] + QUESTIONS[:5])
    assert cli_main(ingest_argv([day2], out, serving, tiny)) == 0
    assert "20 new prompt(s)" in capsys.readouterr().out
    one, two = load(out).rounds
    assert two.name == "round-002" and len(two.seen) == 15 and set(two.seen) < set(one.train) | set(one.eval)
    assert not (set(two.train) | set(two.eval)) & (set(one.train) | set(one.eval))
    assert read_ids(out / "round-002" / "prompts" / SEEN_IDS_FILE, "seen") == set(two.seen)
    assert read_ids(out / "round-002" / "known_ids.txt", "known") == set(one.train) | set(one.eval)


def test_a_round_killed_during_or_after_its_ingest_reruns_to_the_same_ledger(tmp_path, serving, tiny, capsys):
    out = tmp_path / "refresh"
    day1 = write_log(tmp_path / "day1.jsonl", QUESTIONS[:20])
    assert cli_main(ingest_argv([day1], out, serving, tiny)) == 0
    recorded = ledger_text(out)
    # killed after the ingest, before the ledger recorded it: the complete ingest is kept and recorded
    (out / LEDGER_FILE).unlink()
    assert cli_main(ingest_argv([day1], out, serving, tiny)) == 0
    assert "=== ingest: " in capsys.readouterr().out and ledger_text(out) == recorded
    # killed while ingest wrote its folder: ingest runs again and finds the same prompts
    start_output(out / "round-001" / "prompts", "ingest")
    assert cli_main(ingest_argv([day1], out, serving, tiny)) == 0
    assert ledger_text(out) == recorded


def test_another_split_rule_for_a_later_round_is_one_line_before_any_work(tmp_path, serving, tiny, capsys):
    out = tmp_path / "refresh"
    assert cli_main(ingest_argv([write_log(tmp_path / "day1.jsonl", QUESTIONS[:10])], out, serving, tiny)) == 0
    capsys.readouterr()
    day2 = write_log(tmp_path / "day2.jsonl", QUESTIONS[10:20])
    assert cli_main(ingest_argv([day2], out, serving, tiny, "--seed", "7")) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("dflash-train refresh: error: ") and LEDGER_FILE in err
    assert "earlier rounds split their prompts by another rule (seed None -> 7)" in err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["round-001", LEDGER_FILE]


def test_a_refresh_folder_holding_other_files_is_refused_untouched(tmp_path, serving, tiny, capsys):
    out = tmp_path / "refresh"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(ingest_argv([write_log(tmp_path / "day1.jsonl", QUESTIONS[:10])], out, serving, tiny)) == 2
    assert "already holds files that refresh did not write (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["notes.txt"]


def test_a_round_without_a_new_training_prompt_trains_nothing_and_says_so(tmp_path, serving, tiny, capsys):
    """Day 2 adds one prompt: ingest holds it out (a round's eval split is never empty), so there is nothing to
    capture or train, and the serving drafter stays."""
    out = tmp_path / "refresh"
    assert cli_main(ingest_argv([write_log(tmp_path / "day1.jsonl", QUESTIONS[:10])], out, serving, tiny)) == 0
    capsys.readouterr()
    day2 = write_log(tmp_path / "day2.jsonl", QUESTIONS[:11])
    assert cli_main(refresh_argv([day2], out, serving, tiny)) == 0
    assert "refresh: round-002 has no new training prompt: nothing to train, the serving drafter stays" in \
        capsys.readouterr().out
    two = load(out).rounds[1]
    assert (len(two.train), len(two.eval), len(two.seen)) == (0, 1, 10)
    assert sorted(p.name for p in (out / "round-002").iterdir()) == ["known_ids.txt", "prompts", "prompts.command.json"]


@pytest.fixture(scope="module")
def whole_round(tmp_path_factory, serving, tiny):
    """A whole round on the tiny target, run as an operator would after a kill: stopped after its training (as a
    kill would leave it), rerun to its end, then run a third time. The candidate is trained 0 steps, so it is the
    serving drafter's weights. Returns the refresh folder, the command line and what each run printed."""
    tmp = tmp_path_factory.mktemp("whole_round")
    out = tmp / "refresh"
    argv = refresh_argv([write_log(tmp / "day1.jsonl", QUESTIONS[:30])], out, serving, tiny,
                        "--train-override", "train.max_steps=0", "--eval-limit", "3", "--eval-max-new-tokens", "8")
    printed = []
    for args in ([*argv, "--until", "train"], argv, argv):
        with contextlib.redirect_stdout(io.StringIO()) as said:
            assert cli_main(args) == 0
        printed.append(said.getvalue())
        if len(printed) == 1:
            after_training = (load(out).rounds[0], ledger_text(out))
    return out, argv, printed, after_training


def test_a_round_stopped_after_training_goes_on_from_there(whole_round):
    """The store holds the round's training prompts tapped at the serving drafter's layers and the candidate starts
    from exactly the drafter the ledger says was serving; the rerun skips every finished stage."""
    out, _, printed, (one, _) = whole_round
    assert "refresh: round-001 stops after its train (--until train)" in printed[0]
    assert one.release is None and one.figures["drift"]["verdict"] == "unknown"  # no card: unknown
    folder = out / "round-001"
    manifest = json.loads((folder / "store" / "manifest.json").read_text())
    assert manifest["target_layer_ids"] == [1, 3, 5] and manifest["num_samples"] == min(6, len(one.train))
    started = json.loads((folder / "run" / "drafter" / "config.json").read_text())["dflash_train"]["fine_tuned_from"]
    assert started["name"] == "app-dflash" and started["weights_sha256"] == one.serving["weights_sha256"]
    assert printed[1].count("is complete, skipping") == 3 and "recorded in the ledger, skipping" in printed[1]


def test_a_candidate_no_better_than_the_serving_drafter_is_not_released_and_the_same_logs_make_no_new_round(
        whole_round):
    """Side by side in vLLM on the new held-out requests the candidate's tau is the serving drafter's exactly
    (ratio 1, paired by prompt): not better by its interval, it is not released, and the ledger says why. The same
    logs again find the round done and make no second one."""
    out, _, printed, _ = whole_round
    (one,) = load(out).rounds
    assert one.figures["drift"]["prompts"] >= 2
    new = one.figures["against serving (new)"]
    assert new["tau_ratio"] == 1.0 and new["tau_candidate"] == new["tau_serving"] and new["prompts"] >= 2
    assert new["k"] == 3  # the serving drafter's block of 4 less one: its card states no K
    assert one.release["released"] is False
    assert any("not better by its interval" in reason for reason in one.release["reasons"])
    assert "release: the serving drafter stays: new traffic: tau x1.000" in printed[1]
    assert not (out / "round-001" / "release").exists()
    assert "refresh: round-001 is done (these logs made it): not released" in printed[2]
    assert len(load(out).rounds) == 1


def test_a_released_candidate_is_pushed_as_a_new_revision_whose_card_lists_the_rounds(whole_round, tmp_path,
                                                                                       monkeypatch):
    """The release itself, on the round's real candidate and eval, with the decision `decisions.decide` gives a
    better candidate: push's gate passes it (the tiny recipe's push.min_tau 1.0, lossless), the loopback Hub gets one
    commit whose card lists the round, and the release names that commit."""
    from dflash_train.options import from_args
    from dflash_train.refresh import command as refresh_command
    from dflash_train.refresh.decisions import Decision
    from dflash_train.support import runs
    from dflash_train.support.hub_server import LoopbackHub

    out, argv, _, _ = whole_round
    ledger = load(out)
    (one,) = ledger.rounds
    parser = argparse.ArgumentParser()
    refresh_command.add_arguments(parser)
    config = dataclasses.replace(from_args(refresh_command.RefreshConfig, parser.parse_args(argv[1:])),
                                 no_push=False, repo="tiny-org/app-dflash")
    with LoopbackHub(tokens={"hf_test"}) as hub:
        for key, value in {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_test",
                           "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "0"}.items():
            monkeypatch.setenv(key, value)
        release = refresh_command.publish(config, ledger, one, out / one.name / "run" / "drafter", out / one.name,
                                          Decision(True, ["new traffic: better by its interval"]), runs.Log())
        assert release["released"] is True and release["repo"] == "tiny-org/app-dflash"
        assert release["revision"] == hub.head("tiny-org/app-dflash").oid
        assert hub.commit_count("tiny-org/app-dflash") == 2  # the repo's first commit and the release
        card = hub.file_content("tiny-org/app-dflash", "README.md").decode()
    assert "## Refresh rounds" in card and "| 1 | day1.jsonl (sha256 " in card
    assert str(out) not in card
