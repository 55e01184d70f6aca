"""The `dflash-train` command: a thin dispatcher over the stage modules.

Each stage module exposes `add_arguments(parser)`, `run(args) -> int` and INTERRUPTED (what a Ctrl-C leaves and
how to resume: errors.run_as_command prints it); it is imported only when its command runs, so `dflash-train
ingest` never pays for importing the trainer.
"""

from __future__ import annotations

import importlib
import sys

from dflash_train.errors import CommandParser, run_as_command

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ingest": ("dflash_train.stages.ingest.command", "parse, dedup, scrub and split production logs into prompts"),
    "capture": ("dflash_train.stages.capture.command",
                "replay prompts through the target; store its responses and hidden states"),
    "verify": ("dflash_train.store.verify", "re-hash every shard of a capture store and check its manifest"),
    "train": ("dflash_train.stages.train.command",
              "train a drafter from a recipe (same as `accelerate launch train.py`)"),
    "eval": ("dflash_train.stages.evaluate.command", "measure acceptance length with real speculative decoding"),
    "push": ("dflash_train.stages.push.command", "write the model card and upload the drafter to the Hugging Face Hub"),
    "refresh": ("dflash_train.refresh.command",
                "a round of new logs: only the new prompts, a candidate warm-started from the serving drafter"),
}


def _top_level_help() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: dflash-train COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`dflash-train COMMAND --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"dflash-train: unknown command {command!r}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[command]

    def run() -> int:  # the import too: Ctrl-C while it loads torch is the same one line
        module = importlib.import_module(module_name)
        parser = CommandParser(prog=f"dflash-train {command}", description=help_)
        module.add_arguments(parser)
        return module.run(parser.parse_args(rest))

    return run_as_command(f"dflash-train {command}", run, module_name)
