import sys

from dflash_train.cli import main

sys.exit(main())
