"""Train a DFlash drafter from a recipe: `accelerate launch train.py recipes/NAME.yaml [key=value ...]`."""

import os
import sys

# Before torch loads OpenMP: on a CPU shared with other jobs, spinning OpenMP threads wait on each other and a
# 2-thread step runs several times slower than with passive waiting (measured here: 2.8 s vs 1.4 s per step).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dflash_train.stages.train.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
