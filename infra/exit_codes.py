"""Exit codes shared by the trainer and the orchestrator that classifies its attempts.

Distinct codes let the flow tell a preemption (resume at once, not a failure of the code)
from a crash (back off, count towards max_failures) without parsing logs.
"""

SUCCESS = 0
CRASH = 1
BAD_CONFIG = 2
PREEMPTED = 83  # SIGTERM honoured: a checkpoint was saved at the step boundary
CHECKPOINT_INCOMPATIBLE = 84  # nothing to resume from that fits this job's config
ANCHOR_NOT_SAVED = 85  # trained to the end, but the final (anchor) checkpoint failed: retry
