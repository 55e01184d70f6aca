"""`dflash-train refresh` (dflash_train/refresh/command.py) on real logs and a tiny serving drafter: each round
ingests only the prompts no earlier round took, through ingest's own command, and records them; the same logs
again make no second round, and a round killed during or after its ingest reruns to the same ledger."""

import json

import pytest

from dflash_train.cli import main as cli_main
from dflash_train.prompts import SEEN_IDS_FILE, read_ids
from dflash_train.provenance import start_output
from dflash_train.refresh.rounds import LEDGER_FILE, load

QUESTIONS = [f"question number {i}: how far is town {i} from the coast?" for i in range(50)]


@pytest.fixture(scope="module")
def serving(tmp_path_factory, tiny_parts):
    """A tiny drafter folder for the tiny target: the drafter serving now."""
    from tiny import make_tiny_drafter

    from dflash_train.model.checkpoint import save_drafter

    config, tokenizer = tiny_parts
    model, dconfig = make_tiny_drafter(config, tokenizer)
    return save_drafter(model, dconfig, tmp_path_factory.mktemp("serving") / "app-dflash")


def write_log(path, texts):
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def refresh_argv(logs, out, serving, *extra):
    return ["refresh", *map(str, logs), "--out", str(out), "--serving", str(serving), "--eval-fraction", "0.2",
            "--max-prompt-tokens", "0", *extra]


def ledger_text(out):
    return (out / LEDGER_FILE).read_text()


def test_rounds_ingest_only_new_prompts_and_the_same_logs_make_no_second_round(tmp_path, serving, capsys):
    out = tmp_path / "refresh"
    day1 = write_log(tmp_path / "day1.jsonl", QUESTIONS[:30])
    assert cli_main(refresh_argv([day1], out, serving)) == 0
    printed = capsys.readouterr().out
    assert "refresh: round-001" in printed and "30 new prompt(s)" in printed and "0 seen in earlier rounds" in printed
    (one,) = load(out).rounds
    assert len(one.train) + len(one.eval) == 30 and one.serving["name"] == "app-dflash"
    assert one.serving["weights_sha256"] and str(tmp_path) not in ledger_text(out)

    ledger_before = ledger_text(out)
    provenance = (out / "round-001" / "prompts" / "provenance.json").read_bytes()
    moved = write_log(tmp_path / "elsewhere.jsonl", QUESTIONS[:30])  # the same bytes under another name
    assert cli_main(refresh_argv([moved], out, serving)) == 0
    assert "is complete and recorded in the ledger, skipping" in capsys.readouterr().out
    assert ledger_text(out) == ledger_before
    assert (out / "round-001" / "prompts" / "provenance.json").read_bytes() == provenance

    day2 = write_log(tmp_path / "day2.jsonl", QUESTIONS[20:] + QUESTIONS[:5])
    assert cli_main(refresh_argv([day2], out, serving)) == 0
    assert "20 new prompt(s)" in capsys.readouterr().out
    one, two = load(out).rounds
    assert two.name == "round-002" and len(two.seen) == 15 and set(two.seen) < set(one.train) | set(one.eval)
    assert not (set(two.train) | set(two.eval)) & (set(one.train) | set(one.eval))
    assert read_ids(out / "round-002" / "prompts" / SEEN_IDS_FILE, "seen") == set(two.seen)
    assert read_ids(out / "round-002" / "known_ids.txt", "known") == set(one.train) | set(one.eval)


def test_a_round_killed_during_or_after_its_ingest_reruns_to_the_same_ledger(tmp_path, serving, capsys):
    out = tmp_path / "refresh"
    day1 = write_log(tmp_path / "day1.jsonl", QUESTIONS[:20])
    assert cli_main(refresh_argv([day1], out, serving)) == 0
    recorded = ledger_text(out)
    # killed after the ingest, before the ledger recorded it: the complete ingest is kept and recorded
    (out / LEDGER_FILE).unlink()
    assert cli_main(refresh_argv([day1], out, serving)) == 0
    assert "=== ingest: " in capsys.readouterr().out and ledger_text(out) == recorded
    # killed while ingest wrote its folder: ingest runs again and finds the same prompts
    start_output(out / "round-001" / "prompts", "ingest")
    assert cli_main(refresh_argv([day1], out, serving)) == 0
    assert ledger_text(out) == recorded


def test_another_split_rule_for_a_later_round_is_one_line_before_any_work(tmp_path, serving, capsys):
    out = tmp_path / "refresh"
    assert cli_main(refresh_argv([write_log(tmp_path / "day1.jsonl", QUESTIONS[:10])], out, serving)) == 0
    capsys.readouterr()
    day2 = write_log(tmp_path / "day2.jsonl", QUESTIONS[10:20])
    assert cli_main(refresh_argv([day2], out, serving, "--seed", "7")) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("dflash-train refresh: error: ") and LEDGER_FILE in err
    assert "earlier rounds split their prompts by another rule (seed None -> 7)" in err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["round-001", LEDGER_FILE]


def test_a_refresh_folder_holding_other_files_is_refused_untouched(tmp_path, serving, capsys):
    out = tmp_path / "refresh"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(refresh_argv([write_log(tmp_path / "day1.jsonl", QUESTIONS[:10])], out, serving)) == 2
    assert "already holds files that refresh did not write (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["notes.txt"]
