"""The `train` command: train a DFlash drafter from a recipe.

    accelerate launch train.py recipes/NAME.yaml [key=value ...]       (or `dflash-train train RECIPE ...`)

`train` runs the recipe (trainer.DFlashTrainer) in this process; `accelerate launch` starts one such process per
rank.
"""

from __future__ import annotations

import argparse

from dflash_train.errors import CommandParser, run_as_command
from dflash_train.model.checkpoint import RunSummary
from dflash_train.stages.train.recipe import Recipe, load_recipe
from dflash_train.stages.train.trainer import DFlashTrainer

# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("the checkpoints already saved in the run folder are kept; rerun the same command to resume from the "
               "newest (checkpoint.resume: auto, the default)")


def train(recipe: Recipe, recipe_path: str | None = None, overrides: tuple[str, ...] = ()) -> RunSummary:
    """One run of the recipe: setup, the loop, the final drafter; returns the run summary."""
    trainer = DFlashTrainer(recipe, recipe_path, overrides)
    try:
        trainer.setup()
        summary = trainer.train()
        trainer.cleanup()
    finally:
        if trainer.claim is not None:
            trainer.claim.release()
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override recipe keys, dotted: train.max_steps=100 objective.num_anchors=64")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    train(recipe, recipe_path=args.recipe, overrides=tuple(args.overrides))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="train.py", description="train a DFlash drafter from a recipe (run under "
                           "`accelerate launch`)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_as_command("train", lambda: run(args), __name__)
