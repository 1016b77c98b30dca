"""Prefect flows and the ``ett`` CLI.

Importing the package gives the project's loggers a level. Prefect sends the loggers named in
PREFECT_LOGGING_EXTRA_LOGGERS (prefect.yaml: infra, publish, trainer) to a flow run's logs,
but leaves their level to the root logger's, WARNING in a flow run's process, so their INFO
lines (a checkpoint loaded, a model exported) would never get there. Every flow entrypoint
imports from this package, so this runs before any of them; so does the quieting of library
noise (infra/library_logs.py, docs/logging.md) in the process that runs the flow.
"""

import logging

from infra.library_logs import quiet_libraries

PROJECT_LOGGERS = ("infra", "publish", "trainer", "tasks", "flows")

for _name in PROJECT_LOGGERS:
    if logging.getLogger(_name).level == logging.NOTSET:  # never undo a level set on purpose
        logging.getLogger(_name).setLevel(logging.INFO)
quiet_libraries()  # library noise at DEBUG once per job, in a worker's flow run too
