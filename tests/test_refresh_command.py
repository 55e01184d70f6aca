"""`dflash-train refresh` (dflash_train/refresh/command.py) on real logs, the tiny target and a tiny serving drafter:
each round ingests only the prompts no earlier round took, through ingest's own command, and records them; a whole
round measures the serving drafter's drift, captures, trains a candidate warm-started from it and judges it against
the serving drafter side by side in vLLM; the same logs again make no second round, and a round stopped or killed
during or after any stage reruns to the same ledger."""

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
        "checkpoint": {"every": 1000}, "eval": {"every": 0, "at_end": False},
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


def test_a_round_stopped_after_training_goes_on_and_a_candidate_no_better_than_the_serving_drafter_stays(
        tmp_path, serving, tiny, capsys):
    """A whole round on the tiny target, stopped after its training (as a kill would leave it) and rerun. The store
    holds the round's training prompts tapped at the serving drafter's layers and the candidate starts from exactly
    the drafter the ledger says was serving; the rerun skips every finished stage. Trained 0 steps, the candidate is
    the serving drafter's weights, so side by side in vLLM on the new held-out requests its tau is the serving
    drafter's exactly (ratio 1, paired by prompt): not better by its interval, it is not released, and the ledger
    says why. The drift was measured first (the serving drafter has no card: unknown). The same logs again find
    the round done and make no second one."""
    out = tmp_path / "refresh"
    argv = refresh_argv([write_log(tmp_path / "day1.jsonl", QUESTIONS[:30])], out, serving, tiny,
                        "--train-override", "train.max_steps=0", "--eval-limit", "3", "--eval-max-new-tokens", "8")
    assert cli_main([*argv, "--until", "train"]) == 0
    assert "refresh: round-001 stops after its train (--until train)" in capsys.readouterr().out
    (one,) = load(out).rounds
    assert one.release is None and one.figures["drift"]["verdict"] == "unknown"
    folder = out / "round-001"
    manifest = json.loads((folder / "store" / "manifest.json").read_text())
    assert manifest["target_layer_ids"] == [1, 3, 5] and manifest["num_samples"] == min(6, len(one.train))
    started = json.loads((folder / "run" / "drafter" / "config.json").read_text())["dflash_train"]["fine_tuned_from"]
    assert started["name"] == "app-dflash" and started["weights_sha256"] == one.serving["weights_sha256"]

    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("is complete, skipping") == 3 and "recorded in the ledger, skipping" in printed
    (one,) = load(out).rounds
    assert one.figures["drift"]["prompts"] >= 2
    new = one.figures["against serving (new)"]
    assert new["tau_ratio"] == 1.0 and new["tau_candidate"] == new["tau_serving"] and new["prompts"] >= 2
    assert new["k"] == 3  # the serving drafter's block of 4 less one: its card states no K
    assert one.release["released"] is False
    assert any("not better by its interval" in reason for reason in one.release["reasons"])
    assert "release: the serving drafter stays: new traffic: tau x1.000" in printed
    assert not (folder / "release").exists()
    ledger = ledger_text(out)
    assert cli_main(argv) == 0
    assert "refresh: round-001 is done (these logs made it): not released" in capsys.readouterr().out
    assert ledger_text(out) == ledger and len(load(out).rounds) == 1
