"""tasks/attempt_output.py: torchrun's own traceback at DEBUG, everything else as it came."""

from __future__ import annotations

import logging

from tasks.attempt_output import OutputLevels

# What torchrun printed when the trainer was SIGKILLed (trimmed frames, real shape).
LAUNCHER = """\
2026-12-01 02:17:04,611 [rank0] trainer.faults: injecting fault sigkill at step 10
E1201 02:17:04.707000 9811 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 9830)
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File ".../torch/distributed/run.py", line 1032, in <module>
    main()
  File ".../torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File ".../torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=====================================================
trainer FAILED
Root Cause (first observed failure):
  exitcode  : -9 (pid: 9830)  (SIGKILL)
=====================================================""".splitlines()  # noqa: E501

# A rank's own error: the traceback a user needs.
RANK = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/repo/trainer/train.py", line 120, in run
    raise CheckpointError("manifest of step-10 is corrupt")
trainer.checkpoint.manifest.CheckpointError: manifest of step-10 is corrupt
2026-12-01 02:17:05,000 [rank0] trainer: exiting""".splitlines()


def _levels(lines: list[str]) -> list[tuple[int, str]]:
    out = OutputLevels()
    got = [pair for line in lines for pair in out.feed(line)]
    return got + out.flush()


def test_launcher_traceback_goes_to_debug_and_the_summary_stays() -> None:
    got = _levels(LAUNCHER)
    assert [text for _, text in got] == LAUNCHER  # every line, in order
    debug = [text for level, text in got if level == logging.DEBUG]
    assert debug[0] == "Traceback (most recent call last):"
    assert debug[-1].startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailed")
    assert len(debug) == 10
    info = [text for level, text in got if level == logging.INFO]
    assert any("exitcode  : -9" in text for text in info)
    assert any("injecting fault sigkill" in text for text in info)


def test_a_ranks_traceback_stays_at_info() -> None:
    assert {level for level, _ in _levels(RANK)} == {logging.INFO}


def test_output_ending_inside_a_traceback_is_not_lost() -> None:
    assert _levels(RANK[:3]) == [(logging.INFO, line) for line in RANK[:3]]
