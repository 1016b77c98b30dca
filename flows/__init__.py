"""Prefect flows and the ``ett`` CLI.

Importing the package gives the project's loggers a level. Prefect sends the loggers named in
PREFECT_LOGGING_EXTRA_LOGGERS (prefect.yaml: infra, publish, trainer) to a flow run's logs,
but leaves their level to the root logger's, WARNING in a flow run's process, so their INFO
lines (a checkpoint loaded, a model exported) would never get there. Every flow entrypoint
imports from this package, so this runs before any of them.
"""

import logging

PROJECT_LOGGERS = ("infra", "publish", "trainer", "tasks", "flows")

for _name in PROJECT_LOGGERS:
    if logging.getLogger(_name).level == logging.NOTSET:  # never undo a level set on purpose
        logging.getLogger(_name).setLevel(logging.INFO)
