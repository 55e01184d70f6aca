import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from conftest import REPO_ROOT, default_sigint
from dflash_train import cli
from dflash_train.errors import UserError


@pytest.fixture
def fake_stage(monkeypatch):
    module = types.ModuleType("fake_stage")

    def add_arguments(parser):
        parser.add_argument("--fail", action="store_true")
        parser.add_argument("--interrupt", action="store_true")

    def run(args):
        if args.fail:
            raise UserError("prompts folder /x/y has no train split")
        if args.interrupt:
            raise KeyboardInterrupt
        print("ran")
        return 0

    module.add_arguments, module.run = add_arguments, run
    module.INTERRUPTED = "the fake samples are kept; rerun the same command to resume"
    monkeypatch.setitem(sys.modules, "fake_stage", module)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_stage", "a fake stage"))


def test_dispatch_and_user_error_is_one_line(fake_stage, capsys):
    assert cli.main(["fake"]) == 0
    assert capsys.readouterr().out.strip() == "ran"
    assert cli.main(["fake", "--fail"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "dflash-train fake: error: prompts folder /x/y has no train split"


def test_a_bad_argument_is_one_line_without_the_usage_block(fake_stage, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["fake", "--nope"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "dflash-train fake: error: unrecognized arguments: --nope (dflash-train fake --help lists the options)"]


def test_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_every_command_module_has_the_stage_interface():
    import importlib

    for name, (module_name, _) in cli.COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            pytest.fail(f"command {name}: module {module_name} missing ({err})")
        assert callable(module.add_arguments) and callable(module.run), name
        assert isinstance(module.INTERRUPTED, str) and "rerun the same command" in module.INTERRUPTED, name


def test_ctrl_c_is_one_line_with_the_stages_words_and_exit_130(fake_stage, capsys):
    assert cli.main(["fake", "--interrupt"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "dflash-train fake: interrupted: the fake samples are kept; rerun the same command to resume"]


def test_ctrl_c_during_a_capture_keeps_its_shards_in_one_line(tiny_target_dir, tmp_path):
    """A real capture (a subprocess, in its own process group as a terminal's foreground job is) gets SIGINT once
    its first shard is written: exit 130, one line on stderr saying what was kept and how to resume, no
    traceback; the rerun resumes from the shards it kept."""
    from dflash_train.stages.ingest.command import ingest
    from dflash_train.stages.ingest.config import IngestConfig

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"prompt": f"Question {i}: count from {i} to {i + 40}."}) + "\n"
                           for i in range(48)))
    report = ingest([log], tmp_path / "prompts", IngestConfig(max_prompt_tokens=0, progress=False))
    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "dflash_train", "capture", "--prompts", str(tmp_path / "prompts"), "--target",
           str(tiny_target_dir), "--out", str(out), "--layers", "1,3", "--max-new-tokens", "24", "--batch-size", "2",
           "--dtype", "fp32", "--shard-size-mb", "0.005"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), TQDM_DISABLE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    journal = out / "journal-r000.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and json.loads(journal.read_text())["shards"]:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert not (out / "manifest.json").exists(), "the capture finished before it could be interrupted"
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == 130 and err.strip().splitlines() == [
        "dflash-train capture: interrupted: the samples of the shards already written are kept (the store stays "
        "marked INCOMPLETE); rerun the same command to resume"], err[-3000:]
    kept = sum(len(shard["ids"]) for shard in json.loads(journal.read_text())["shards"])
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and f"{report['train'] - kept} prompt(s) left" in rerun.stdout, rerun.stdout + rerun.stderr
