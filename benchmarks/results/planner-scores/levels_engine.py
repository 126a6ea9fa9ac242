"""A mode-auto engine built as `bench levels` builds one, for this folder's scripts."""
import argparse

import client.bench_levels as BL
from client.bench_compare import build_engines


def levels_args(*extra: str) -> argparse.Namespace:
    """`bench levels`' default arguments (and `extra` on its command line)."""
    ap = argparse.ArgumentParser()
    BL.add_levels_parser(ap.add_subparsers())
    return ap.parse_args(["levels", *extra])


def auto_engine():
    """(engine, placement, `bench levels`' default arguments) for mode auto, its graphs not yet
    run (`client.bench_levels.compile_warm_up` does that)."""
    args = levels_args("--configs", "auto")
    engine, placement = build_engines(args, ["auto"])["auto"]
    return engine, placement, args
