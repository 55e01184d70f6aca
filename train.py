"""Train a DFlash drafter from a recipe: `accelerate launch train.py recipes/NAME.yaml [key=value ...]`."""

import sys

from dflash_train.trainer import main

if __name__ == "__main__":
    sys.exit(main())
