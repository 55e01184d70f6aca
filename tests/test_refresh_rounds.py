"""The refresh ledger (dflash_train/refresh/rounds.py): a round is the content of its logs, it keeps the ids it
ingested (by split) and those it skipped as seen, the split rule is the first round's, and a damaged ledger is one
line naming the file."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from dflash_train.errors import UserError, run_as_command
from dflash_train.refresh.rounds import LEDGER_FILE, SplitRule, hash_logs, load, round_id

RULE = SplitRule(eval_fraction=0.2, seed=None, scrub=True)
SERVING = {"name": "org/app-dflash", "repo": "org/app-dflash", "revision": "abc123"}
A, B, C, D, E = (f"{c * 31}{n}" for n, c in enumerate("abcde"))  # prompt ids: 32 hex digits


def logs_of(tmp_path, **texts):
    """Log files named after the keywords, holding their texts."""
    paths = []
    for name, text in texts.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        paths.append(path)
    return paths


def test_the_same_logs_renamed_moved_or_reordered_are_the_same_round(tmp_path):
    first = logs_of(tmp_path, day1='{"prompt": "a"}\n', extra='{"prompt": "b"}\n')
    ledger = load(tmp_path / "refresh")
    rnd = ledger.begin(hash_logs(first), SERVING, RULE)
    assert rnd.number == 1 and rnd.name == "round-001"
    ledger.record_ingest(rnd, train=[A], eval=[B], seen=[])
    elsewhere = tmp_path / "copies"
    elsewhere.mkdir()
    moved = [Path(shutil.copy(first[1], elsewhere / "x.jsonl")), Path(shutil.copy(first[0], elsewhere / "y.jsonl"))]
    again = load(tmp_path / "refresh").begin(hash_logs(moved), SERVING, RULE)
    assert (again.id, again.number, again.train, again.eval) == (rnd.id, 1, [A], [B])
    assert len(load(tmp_path / "refresh").rounds) == 1
    # one byte more is other logs
    moved[0].write_text('{"prompt": "b"}\n\n')
    assert round_id(hash_logs(moved)) != rnd.id


def test_a_round_records_its_logs_by_name_and_hash_and_no_folder_of_this_machine(tmp_path):
    paths = logs_of(tmp_path, day1='{"prompt": "a"}\n')
    ledger = load(tmp_path / "refresh")
    ledger.record_ingest(ledger.begin(hash_logs(paths), SERVING, RULE), train=[B, A], eval=[C], seen=[])
    text = (tmp_path / "refresh" / LEDGER_FILE).read_text()
    assert str(tmp_path) not in text
    (saved,) = json.loads(text)["rounds"]
    assert saved["logs"] == [{"name": "day1.jsonl", "sha256": hashlib.sha256(paths[0].read_bytes()).hexdigest(),
                              "bytes": paths[0].stat().st_size}]
    assert saved["serving"] == SERVING and (saved["train"], saved["eval"], saved["seen"]) == ([A, B], [C], [])
    assert saved["figures"] is None and saved["release"] is None


def test_two_logs_with_the_same_bytes_or_the_same_name_are_refused(tmp_path):
    paths = logs_of(tmp_path, a='{"prompt": "a"}\n', b='{"prompt": "a"}\n')
    with pytest.raises(UserError, match=r"log files a.jsonl and .*b.jsonl hold the same bytes"):
        hash_logs(paths)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.jsonl").write_text('{"prompt": "c"}\n')
    with pytest.raises(UserError, match=r"two log files are named a.jsonl \(.*other/a.jsonl is the second\)"):
        hash_logs([paths[0], tmp_path / "other" / "a.jsonl"])


def test_a_round_keeps_its_new_ids_by_split_and_the_ids_it_skipped_as_seen(tmp_path):
    ledger = load(tmp_path / "refresh")
    one = ledger.begin(hash_logs(logs_of(tmp_path, day1="1\n")), SERVING, RULE)
    ledger.record_ingest(one, train=[B, A], eval=[C], seen=[])
    two = ledger.begin(hash_logs(logs_of(tmp_path, day2="2\n")), SERVING, RULE)
    assert ledger.known_ids(two) == {A, B, C}
    ledger.record_ingest(two, train=[D], eval=[E], seen=[C, A])
    reread = load(tmp_path / "refresh")
    assert [(r.train, r.eval, r.seen) for r in reread.rounds] == [([A, B], [C], []), ([D], [E], [A, C])]
    assert reread.split_of(C) == "eval" and reread.split_of(D) == "train" and reread.split_of("f" * 32) is None
    # recording the same result again changes nothing; another result is refused
    reread.record_ingest(reread.rounds[1], train=[D], eval=[E], seen=[A, C])
    with pytest.raises(UserError, match=r"round-002: its ingest found other prompts than recorded before \(train 1 "
                                        r"-> 2"):
        reread.record_ingest(reread.rounds[1], train=[D, "f" * 32], eval=[E], seen=[A, C])


@pytest.mark.parametrize("train, eval_, seen, refused", [
    ([D, C], [E], [], r"round-002: 1 prompt\(s\) it ingested as new were ingested by an earlier round \(first "
                      rf"{C}, eval there\)"),
    ([D], [E], ["f" * 32], r"round-002: 1 prompt\(s\) it skipped as seen were ingested by no earlier round \(first "
                           r"f{32}\)"),
    ([D], [D], [], rf"round-002: prompt {D} is in both splits"),
])
def test_a_round_whose_ids_contradict_earlier_rounds_is_refused_and_not_recorded(tmp_path, train, eval_, seen,
                                                                               refused):
    ledger = load(tmp_path / "refresh")
    ledger.record_ingest(ledger.begin(hash_logs(logs_of(tmp_path, day1="1\n")), SERVING, RULE), [A, B], [C], [])
    two = ledger.begin(hash_logs(logs_of(tmp_path, day2="2\n")), SERVING, RULE)
    with pytest.raises(UserError, match=refused):
        ledger.record_ingest(two, train=train, eval=eval_, seen=seen)
    assert len(load(tmp_path / "refresh").rounds) == 1


def test_a_round_enters_the_ledger_with_its_ingest_and_one_killed_before_leaves_no_trace(tmp_path):
    ledger = load(tmp_path / "refresh")
    ledger.begin(hash_logs(logs_of(tmp_path, day1="1\n")), SERVING, RULE)
    assert not (tmp_path / "refresh" / LEDGER_FILE).exists()
    ledger = load(tmp_path / "refresh")
    two = ledger.begin(hash_logs(logs_of(tmp_path, day2="2\n")), SERVING, RULE)
    assert two.number == 1
    ledger.record_ingest(two, [A], [B], [])
    assert [r.logs[0].name for r in load(tmp_path / "refresh").rounds] == ["day2.jsonl"]


def test_a_rounds_figures_and_release_are_saved_and_a_released_round_is_found_done(tmp_path):
    ledger = load(tmp_path / "refresh")
    logs = hash_logs(logs_of(tmp_path, day1="1\n"))
    one = ledger.begin(logs, SERVING, RULE)
    with pytest.raises(ValueError, match="record its ingest first"):  # figures belong to a recorded round
        ledger.record_figure(one, "drift", {"verdict": "held"})
    ledger.record_ingest(one, [A], [B], [])
    ledger.record_figure(one, "drift", {"verdict": "moved down", "tau": 1.5})
    ledger.record_figure(one, "against serving (new)", {"tau_ratio": 1.3})
    ledger.record_release(one, {"released": True, "reasons": ["new traffic: better"], "folder": "round-001/release"})
    again = load(tmp_path / "refresh").begin(logs, SERVING, RULE)
    assert again.figures == {"drift": {"verdict": "moved down", "tau": 1.5}, "against serving (new)": {"tau_ratio": 1.3}}
    assert again.release == {"released": True, "reasons": ["new traffic: better"], "folder": "round-001/release"}


def test_another_split_rule_or_serving_drafter_for_a_round_is_refused(tmp_path):
    ledger = load(tmp_path / "refresh")
    logs = hash_logs(logs_of(tmp_path, day1="1\n"))
    ledger.record_ingest(ledger.begin(logs, SERVING, RULE), [A], [B], [])
    day2 = hash_logs(logs_of(tmp_path, day2="2\n"))
    for rule, named in ((SplitRule(0.1, None, True), "eval_fraction 0.2 -> 0.1"), (SplitRule(0.2, 7, True),
                        "seed None -> 7"), (SplitRule(0.2, None, False), "scrub True -> False")):
        with pytest.raises(UserError, match=rf"earlier rounds split their prompts by another rule \({named}\)"):
            ledger.begin(day2, SERVING, rule)
    with pytest.raises(UserError, match=r"round-001 \(these logs\) began from the serving drafter org/app-dflash at "
                                        r"revision abc123, not org/app-dflash at revision def456"):
        ledger.begin(logs, {**SERVING, "revision": "def456"}, RULE)
    with pytest.raises(UserError, match=r"began from the serving drafter org/app-dflash at revision abc123, not "
                                        r"org/app-dflash at revision abc123 \(other weights\)"):
        ledger.begin(logs, {**SERVING, "weights_sha256": {"model.safetensors": "0" * 64}}, RULE)
    assert len(load(tmp_path / "refresh").rounds) == 1


def valid_ledger(tmp_path) -> dict:
    ledger = load(tmp_path / "refresh")
    ledger.record_ingest(ledger.begin(hash_logs(logs_of(tmp_path, day1="1\n")), SERVING, RULE), [A], [B], [])
    return json.loads((tmp_path / "refresh" / LEDGER_FILE).read_text())


@pytest.mark.parametrize("damage, named", [
    (lambda d: "{not json", r"is not a readable refresh ledger \(JSONDecodeError"),
    (lambda d: [], r"is not a refresh ledger: the file is a JSON list, not an object"),
    (lambda d: {**d, "format": 99}, r"format 99 \(this version reads format 1\)"),
    (lambda d: {k: v for k, v in d.items() if k != "rounds"}, r"rounds is missing"),
    (lambda d: {**d, "rounds": [{**d["rounds"][0], "train": "abc"}]}, r"rounds\[0\].train is \"abc\", not a list"),
    (lambda d: {**d, "rounds": [{**d["rounds"][0], "eval": None}]}, r"rounds\[0\].eval is null, not a list"),
    (lambda d: {**d, "rounds": [{**d["rounds"][0], "id": "0" * 64}]}, r"rounds\[0\].id is not the identity of its "
                                                                      r"logs"),
    (lambda d: {**d, "rounds": [{**d["rounds"][0], "number": 2}]}, r"rounds\[0\].number is 2, not 1"),
    (lambda d: {**d, "split": {**d["split"], "scrub": 1}}, r"split.scrub is 1, not true or false"),
    (lambda d: {**d, "rounds": d["rounds"] * 2}, r"rounds\[1\].number is 1, not 2"),
    (lambda d: {**d, "rounds": [*d["rounds"], {**d["rounds"][0], "number": 2}]}, r"rounds\[1\] has the logs of "
                                                                                 r"rounds\[0\]"),
])
def test_a_damaged_ledger_is_one_line_naming_the_file_exit_2_and_stays_as_it_was(tmp_path, capsys, damage, named):
    path = tmp_path / "refresh" / LEDGER_FILE
    damaged = damage(valid_ledger(tmp_path))
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    before = path.read_bytes()
    assert run_as_command("dflash-train refresh", lambda: load(tmp_path / "refresh")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"dflash-train refresh: error: {path} ")
    assert re.search(named, err), err
    assert path.read_bytes() == before


# --- rounds of real ingests: new prompts only, splits that never change -----------------------------------------------


def texts_by_hash(low: float, high: float, n: int, start: int = 0) -> list[str]:
    """`n` prompts whose split hash (as ingest ids them) lies in [low, high), from a pool of questions."""
    from dflash_train.logs.records import prompt_id
    from dflash_train.prompts import split_hash

    found = []
    for i in range(start, start + 5000):
        text = f"how far is town {i} from the coast?"
        if low <= split_hash(prompt_id([{"role": "user", "content": text}])) < high:
            found.append(text)
            if len(found) == n:
                return found
    raise AssertionError("the pool is too small")


def ids_of(texts: list[str]) -> set[str]:
    from dflash_train.logs.records import prompt_id

    return {prompt_id([{"role": "user", "content": t}]) for t in texts}


def write_log(tmp_path, name: str, texts: list[str]):
    log = tmp_path / f"{name}.jsonl"
    log.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return log


def ingest_round(ledger, rnd, log, tmp_path, exclude=True):
    """Ingest the round's log (with --exclude-ids holding the ids earlier rounds took) into its prompts folder, as
    refresh does; returns the folder."""
    from dflash_train.prompts import write_ids
    from dflash_train.stages.ingest.command import ingest
    from dflash_train.stages.ingest.config import IngestConfig

    known = tmp_path / f"{rnd.name}-known.txt"
    write_ids(known, ledger.known_ids(rnd))
    out = tmp_path / rnd.name / ("prompts" if exclude else "plain")
    ingest([log], out, IngestConfig(eval_fraction=RULE.eval_fraction, max_prompt_tokens=0, progress=False,
                                    exclude_ids=str(known) if exclude else None))
    return out


def test_a_prompts_split_never_changes_from_one_round_to_the_next(tmp_path):
    """Day 1's logs hold no prompt under the eval fraction, so ingest's fallback holds out the lowest-hash one (P),
    which the hash rule alone would put in train. Day 2's logs repeat day 1's and add prompts under the fraction: an
    ingest of them all (no exclusion) moves P into train, a held-out prompt leaking into training; the round's
    ingest skips day 1's prompts as seen, so P stays held out, and the ledger refuses the leaking result."""
    from test_ingest import split_ids

    from dflash_train.refresh.rounds import ingested_ids

    day1 = texts_by_hash(0.5, 1.0, 6)
    day2_new = texts_by_hash(0.0, 0.2, 2) + texts_by_hash(0.2, 1.0, 8, start=1000)
    ledger = load(tmp_path / "refresh")
    log1 = write_log(tmp_path, "day1", day1)
    one = ledger.begin(hash_logs([log1]), SERVING, RULE)
    ledger.record_ingest(one, *ingested_ids(ingest_round(ledger, one, log1, tmp_path)))
    assert len(one.eval) == 1 and set(one.train) | set(one.eval) == ids_of(day1)
    (held_out,) = one.eval

    log2 = write_log(tmp_path, "day2", day1 + day2_new)
    two = ledger.begin(hash_logs([log2]), SERVING, RULE)
    plain = ingest_round(ledger, two, log2, tmp_path, exclude=False)
    assert held_out in split_ids(plain)[0]  # what the round must not do
    with pytest.raises(UserError, match=r"round-002: 6 prompt\(s\) it ingested as new were ingested by an earlier "
                                        r"round"):
        ledger.record_ingest(two, *split_ids(plain), [])
    ledger.record_ingest(two, *ingested_ids(ingest_round(ledger, two, log2, tmp_path)))
    assert set(two.seen) == ids_of(day1) and set(two.eval) == ids_of(day2_new[:2])
    assert set(two.train) == ids_of(day2_new[2:])

    # day 3: nothing new under the fraction, and a held-out prompt of day 2 again: the fallback picks a new prompt
    day3_new = texts_by_hash(0.5, 1.0, 3, start=2000)
    log3 = write_log(tmp_path, "day3", day3_new + day2_new[:1])
    three = ledger.begin(hash_logs([log3]), SERVING, RULE)
    ledger.record_ingest(three, *ingested_ids(ingest_round(ledger, three, log3, tmp_path)))
    assert set(three.seen) == ids_of(day2_new[:1]) and len(three.eval) == 1
    assert set(three.train) | set(three.eval) == ids_of(day3_new)

    reread = load(tmp_path / "refresh")
    splits = {i: split for r in (one, two, three) for split in ("train", "eval") for i in getattr(r, split)}
    assert {i: reread.split_of(i) for i in splits} == splits and reread.split_of(held_out) == "eval"
