"""matplotlib for the benchmarks' PNGs, or None (with a note) where it is not installed."""
from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None: a benchmark then skips its plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    return plt
