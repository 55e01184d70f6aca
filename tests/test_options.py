"""Stage options stated once: the CLI derived from the config dataclasses, and every value checked before any work
starts (one line naming the flag and the value, exit 2)."""

import argparse
import json
from dataclasses import dataclass
from typing import Literal

import pytest

from dflash_train.cli import main
from dflash_train.errors import UserError
from dflash_train.options import add_options, at_least, from_args, in_range, option, validate


@dataclass
class Demo:
    out: str = option(help="where")
    limit: int | None = option(None, check=at_least(1), help="only N")
    share: float = option(0.5, check=in_range(0, 1, low_open=True), help="a share")
    mode: Literal["a", "b"] = option("a", help="which")
    ids: list[int] | None = option(None, help="ids")
    extra: list[str] = option(default_factory=list, flag="--extra-dir", help="repeatable")
    warm: bool = option(True, help="skip the warm-up")
    kwargs: dict | None = option(None, help="JSON")


def parse(*argv: str) -> Demo:
    parser = argparse.ArgumentParser()
    add_options(parser, Demo)
    return from_args(Demo, parser.parse_args(list(argv)))


def test_flags_types_defaults_and_help_come_from_the_fields():
    cfg = parse("--out", "o", "--ids", "1,5", "--extra-dir", "x", "--extra-dir", "y", "--no-warm", "--kwargs",
                '{"a": 1}', "--mode", "b")
    assert cfg == Demo(out="o", ids=[1, 5], extra=["x", "y"], warm=False, kwargs={"a": 1}, mode="b")
    assert parse("--out", "o") == Demo(out="o")  # defaults, and a fresh list for the repeatable option
    assert parse("--out", "o").extra == [] and parse("--out", "o").extra is not parse("--out", "o").extra
    with pytest.raises(SystemExit):
        parse("--limit", "3")  # --out is required


@pytest.mark.parametrize("argv, message", [
    (["--limit", "-5"], "--limit -5 must be a number >= 1"),
    (["--share", "nan"], "--share nan must be in (0, 1]"),
    (["--share", "inf"], "--share inf must be in (0, 1]"),
    (["--share", "0"], "--share 0.0 must be in (0, 1]"),
])
def test_bad_values_are_one_error_naming_the_flag(argv, message):
    with pytest.raises(UserError) as err:
        parse("--out", "o", *argv)
    assert str(err.value) == message


def test_configs_built_in_code_are_checked_the_same_way():
    with pytest.raises(UserError, match="--mode 'c' must be one of a, b"):
        validate(Demo(out="o", mode="c"))


@pytest.mark.parametrize("argv, message", [
    (["capture", "--prompts", "p", "--out", "o", "--shard-size-mb", "nan"], "--shard-size-mb nan must be in (0, "),
    (["capture", "--prompts", "p", "--out", "o", "--limit", "-5"], "--limit -5 must be a number >= 1"),
    (["capture", "--prompts", "p", "--out", "o", "--top-p", "1.5"], "--top-p 1.5 must be a finite number in [0, 1]"),
    (["eval", "--drafter", "d", "--prompts", "p", "--out", "o", "--temperature", "nan"],
     "--temperature nan must be a finite number in [0, 2]"),
    (["eval", "--drafter", "d", "--prompts", "p", "--out", "o", "--block-size", "1"],
     "--block-size 1 must be a number >= 2"),
    (["eval", "--drafter", "d", "--prompts", "p", "--out", "o", "--speculative-tokens", "3,0"],
     "--speculative-tokens [3, 0] has 0, which must be a number >= 1"),
    (["eval", "--drafter", "d", "--prompts", "p", "--out", "o", "--concurrency", "4,1"],
     "--concurrency [4, 1] has 1, which must be a number >= 2"),
    (["eval", "--drafter", "d", "--prompts", "p", "--out", "o", "--ngram", "3,2,3"], "--ngram [3, 2, 3] has 3 twice"),
    (["eval", "--drafter", "d", "--prompts", "p", "--out", "o", "--sweep-budget-s", "-1"],
     "--sweep-budget-s -1.0 must be a number >= 0"),
    (["ingest", "--out", "o", "--eval-fraction", "1"], "--eval-fraction 1.0 must be in (0, 1)"),
    (["push", "d", "--repo", "org/name", "--min-tau", "nan"], "--min-tau nan must be a number >= 1"),
])
def test_stage_flags_are_checked_before_any_work(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_eval_refuses_a_block_larger_than_the_drafter_drafts(tiny_target, tiny_target_dir, tmp_path, capsys):
    from tiny import make_tiny_drafter

    from dflash_train.model.checkpoint import save_drafter

    drafter = save_drafter(*make_tiny_drafter(tiny_target.config, tiny_target.tokenizer, block_size=4),
                           tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    rc = main(["eval", "--engine", "own", "--drafter", str(drafter), "--target", str(tiny_target_dir), "--prompts",
               str(prompts), "--out", str(tmp_path / "e"), "--block-size", "100000"])
    err = capsys.readouterr().err
    assert rc == 2 and "--block-size 100000 is outside 2..4" in err and not (tmp_path / "e").exists()
