"""Output folders: each run claims its folder (stage ownership + a lock), and the completeness markers."""

import json
import re
import subprocess
import sys

import pytest

from dflash_train.errors import UserError
from dflash_train.provenance import (LOCK_FILE, OutputClaim, config_differences, read_json, shown_pair, stage_of,
                                     start_output, write_provenance)


def test_a_second_run_into_a_folder_being_written_is_refused_naming_it(tmp_path):
    out = tmp_path / "store"
    first = OutputClaim(out, "capture")
    with pytest.raises(UserError, match=re.escape(str(out)) + r" is being written by another run right now \(capture, "
                                        r"pid \d+"):
        OutputClaim(out, "capture")
    # the same from another process: the lock is a real file lock, not an in-process flag
    code = (f"from dflash_train.provenance import OutputClaim\nfrom dflash_train.errors import UserError\n"
            f"try:\n    OutputClaim({str(out)!r}, 'capture')\nexcept UserError as e:\n    print(e)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "is being written by another run" in other.stdout, other.stdout + other.stderr
    first.release()
    OutputClaim(out, "capture").release()  # free again once the first run is done


def test_a_folder_of_another_stage_or_of_someone_else_is_refused_untouched(tmp_path):
    ingest_out = tmp_path / "prompts"
    start_output(ingest_out, "ingest")
    write_provenance(ingest_out, stage="ingest")
    before = {p.name: p.read_bytes() for p in ingest_out.iterdir()}
    with pytest.raises(UserError, match=r"holds the output of `dflash-train ingest`, not of capture"):
        OutputClaim(ingest_out, "capture")
    assert {p.name: p.read_bytes() for p in ingest_out.iterdir()} == before  # no lock file, nothing rewritten

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "shard-r000-00000.safetensors").write_text("not a shard of ours")
    with pytest.raises(UserError, match=r"already holds files that capture did not write \(shard-r000-00000"):
        OutputClaim(foreign, "capture")
    assert [p.name for p in foreign.iterdir()] == ["shard-r000-00000.safetensors"]
    # what the stage recognises as its own output from before folders recorded their stage is still accepted
    OutputClaim(foreign, "capture", legacy=lambda folder: True).release()


def test_the_outputs_of_train_and_eval_are_told_from_a_users_files_of_the_same_name(tmp_path):
    """Their folders from before stages were recorded were recognised by a recipe.yaml or a report.json alone, and a
    user's own file of that name was overwritten."""
    from dflash_train.stages.evaluate.command import is_eval_folder
    from dflash_train.stages.train.run_folder import STATE_FILE, is_run_folder

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "recipe.yaml").write_text("# my recipe\n")
    (mine / "report.json").write_text('{"mine": 1}')
    assert not is_run_folder(mine) and not is_eval_folder(mine)
    for stage, legacy in (("train", is_run_folder), ("eval", is_eval_folder)):
        with pytest.raises(UserError, match="already holds files that .* did not write"):
            OutputClaim(mine, stage, legacy=legacy)
    assert sorted(p.name for p in mine.iterdir()) == ["recipe.yaml", "report.json"]
    (mine / "checkpoints" / "step-0000002").mkdir(parents=True)
    (mine / "checkpoints" / "step-0000002" / STATE_FILE).write_text("{}")
    (mine / "report.json").write_text('{"tau": 1.3, "settings": {}}')
    assert is_run_folder(mine) and is_eval_folder(mine)


def test_a_json_record_that_is_not_an_object_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"config.json holds a JSON list, not an object \(a drafter's config\)$"):
        read_json(tmp_path / "config.json", "a drafter's config")


def test_an_output_folder_below_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("data")
    with pytest.raises(UserError, match=r"afile/sub: a part of the path is a file, not a folder"):
        OutputClaim(tmp_path / "afile" / "sub", "ingest")


def test_a_new_folder_is_marked_with_its_stage_and_removed_when_the_run_fails_early(tmp_path):
    out = tmp_path / "a" / "eval"
    with pytest.raises(RuntimeError):
        with OutputClaim(out, "eval"):
            assert (out / LOCK_FILE).exists()
            raise RuntimeError("bad input found before anything was written")
    assert not out.exists()
    with OutputClaim(out, "eval"):
        start_output(out, "eval")
    assert stage_of(out) == "eval" and json.loads((out / "INCOMPLETE").read_text())["stage"] == "eval"


def test_a_claim_that_loses_the_race_for_a_new_folder_leaves_the_winners_folder(tmp_path):
    """Two runs start on one new folder: the second claims it between the first's mkdir and its lock. The first is
    refused, and its cleanup used to remove the folder (new to it, holding only a lock file) under the winner."""
    out = tmp_path / "store"
    winner = []

    class OvertakenClaim(OutputClaim):
        def _acquire(self):
            winner.append(OutputClaim(self.out, "capture"))  # the other run, at the worst moment
            super()._acquire()

    with pytest.raises(UserError, match="is being written by another run right now"):
        OvertakenClaim(out, "capture")
    assert (out / LOCK_FILE).exists()
    start_output(out, "capture")  # the winner writes on
    assert stage_of(out) == "capture"
    winner[0].release()


def test_a_failed_run_leaving_its_new_folder_never_removes_it_under_a_run_that_claimed_it(tmp_path):
    """A run that created its folder fails with nothing written and releases it; another run claims the folder the
    moment the lock is free. Its folder used to be removed after the unlock, under it."""
    out = tmp_path / "eval"
    failed = OutputClaim(out, "eval")
    others = []

    class UnlockThenAnotherRun:
        def __init__(self, lock):
            self.lock = lock

        def release(self):
            self.lock.release()
            others.append(OutputClaim(out, "eval"))  # the other run, at the worst moment

    failed._lock = UnlockThenAnotherRun(failed._lock)
    failed.release(failed=True)
    assert len(others) == 1 and (out / LOCK_FILE).exists()
    with pytest.raises(UserError, match="is being written by another run right now"):
        OutputClaim(out, "eval")  # the folder is the other run's, and locked by it
    others[0].release(failed=True)
    assert not out.exists()  # the other run created it anew, so its own failure removes it


def test_config_differences_name_the_key_path_and_cut_long_values_around_the_difference():
    old = {"a": {"b": [1, 2, {"c": "x" * 300 + "old"}]}, "d": 1}
    new = {"a": {"b": [1, 2, {"c": "x" * 300 + "new"}]}, "d": 1, "e": 2}
    diffs = config_differences(old, new)
    assert [d[0] for d in diffs] == ["a.b.2.c", "e"]
    shown_old, shown_new = shown_pair(diffs[0][1], diffs[0][2])
    assert shown_old.endswith('old"') and shown_new.endswith('new"') and len(shown_old) < 80
    assert repr(diffs[1][1]) == "(not set)"
