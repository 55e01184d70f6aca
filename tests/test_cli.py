import sys
import types

import pytest

from dflash_train import cli
from dflash_train.errors import UserError


@pytest.fixture
def fake_stage(monkeypatch):
    module = types.ModuleType("fake_stage")

    def add_arguments(parser):
        parser.add_argument("--fail", action="store_true")

    def run(args):
        if args.fail:
            raise UserError("prompts folder /x/y has no train split")
        print("ran")
        return 0

    module.add_arguments, module.run = add_arguments, run
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
