"""The ``nightdraft`` loggers, forwarded to Triton's log (``pb_utils.Logger``)."""
from __future__ import annotations

import logging
from typing import Any


class PbLogHandler(logging.Handler):
    """Forward log records to Triton's log at the matching level."""

    def __init__(self, pb_utils: Any):
        super().__init__(logging.INFO)
        self._logger = pb_utils.Logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            if record.levelno >= logging.ERROR:
                self._logger.log_error(msg)
            elif record.levelno >= logging.WARNING:
                self._logger.log_warn(msg)
            else:
                self._logger.log_info(msg)
        except Exception:  # never let logging break serving
            pass


def install_log_bridge(pb_utils: Any) -> None:
    """Once per process: the ``nightdraft`` loggers write to Triton's log, and only there."""
    root = logging.getLogger("nightdraft")
    if not any(isinstance(h, PbLogHandler) for h in root.handlers):
        h = PbLogHandler(pb_utils)
        h.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False
