"""The planner's link to the server (mode ``auto``): Triton's metrics in, its summary out.

In: the model parameter ``metrics_url`` (empty = off) names Triton's metrics endpoint; a
scraper (:mod:`backend.serving.metrics_scraper`) follows it in a thread, and its ``merge``
is the engine's ``extra_signals``: it fills the server's fields into every load snapshot the
planner gets. The adapter owns the scraper and closes it at finalize.

Out: at unload, what the planner did over the model's life (``Planner.summary()``: arm counts,
switches, what each offload promised and delivered) is written as JSON to the file named by the
model parameter ``planner_summary_file`` (empty = off; relative to the version directory), which
``nightdraft bench dynamic --server`` sets and reads; it is also logged on one line for operators.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from backend.mode import Mode
from backend.serving.config import ModelArgs

log = logging.getLogger("nightdraft.triton")

METRICS_URL = "metrics_url"
SUMMARY_FILE = "planner_summary_file"
SUMMARY_LOG_PREFIX = "planner summary: "


def server_signals(margs: ModelArgs, mode: Mode | str) -> Any | None:
    """The scraper of Triton's metrics endpoint, started; None when ``metrics_url`` is unset
    (or the engine does not plan: mode is not auto)."""
    url = margs.param(METRICS_URL)
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise margs.fail(f"parameter {METRICS_URL} must be an http(s) URL, got {url!r}")
    if Mode.parse(mode) is not Mode.AUTO:
        log.info("%s: %s is used by mode auto only; not scraping it in mode %s", margs.name,
                 METRICS_URL, mode)
        return None
    from backend.serving.metrics_scraper import TritonMetricsSignals
    return TritonMetricsSignals(url)


def export_summary(name: str, planner: Any, path: Path | None) -> None:
    """Log the planner's summary on one line, and write it to ``path`` (when set) as JSON with
    the per-bin detail and the timeline (``Planner.stats()``: what each arm measured in each
    batch bin, which is what tells why it chose what it did)."""
    summary = planner.summary()
    log.info("%s: %s%s", name, SUMMARY_LOG_PREFIX, json.dumps(summary, default=str))
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(planner.stats(), indent=2, default=str))
    os.replace(tmp, path)      # a reader never sees half a file
    log.info("%s: planner summary written to %s", name, path)
