"""``python -m trainer --config FILE``: one attempt of a training job (under torchrun or alone)."""

import sys

from trainer.train import main

sys.exit(main())
