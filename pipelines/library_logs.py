"""The library's warnings in the Prefect UI, however the flow was started.

Prefect attaches its API log handler to `PREFECT_LOGGING_EXTRA_LOGGERS` once, when `prefect` is first
imported. The stages set that variable before; a served deployment (`python -m pipelines.serve`) or a node
host imports Prefect first, so a set-aside damaged round, a refused file or a retried storage call would
reach only the terminal. Each flow attaches the same handlers to the `spes` logger when it starts.
"""
from __future__ import annotations

import logging

LIBRARY_LOGGER = "spes"


def relay_library_logs() -> None:
    """Give the `spes` logger the API handler of Prefect's `prefect.extra` logger, once. Only that one: other
    handlers found there belong to someone else (pytest attaches its capture handlers to every logger that does
    not propagate, and a copy of one outlives the test, catching each later record twice)."""
    from prefect.logging.handlers import APILogHandler

    library = logging.getLogger(LIBRARY_LOGGER)
    for handler in logging.getLogger("prefect.extra").handlers:
        if isinstance(handler, APILogHandler) and handler not in library.handlers:
            library.addHandler(handler)
