"""A mode-auto engine built as `bench levels` builds one, for this folder's scripts."""
import argparse

import client.bench_levels as BL
from client.bench_compare import build_engines


def auto_engine():
    """(engine, placement, `bench levels`' default arguments) for mode auto, its graphs not yet
    run (`client.bench_levels.compile_warm_up` does that)."""
    ap = argparse.ArgumentParser()
    BL.add_levels_parser(ap.add_subparsers())
    args = ap.parse_args(["levels", "--configs", "auto"])
    engine, placement = build_engines(args, ["auto"])["auto"]
    return engine, placement, args
