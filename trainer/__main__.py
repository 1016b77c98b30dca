"""``python -m trainer --config FILE``: one attempt of a training job (under torchrun or alone)."""

import sys

from trainer import gc_policy

gc_policy.pause()  # before the imports: see trainer/gc_policy.py

from trainer.train import main  # noqa: E402

sys.exit(main())
