"""The `nightdraft` command: serve, install-backend, complete, bench."""
from __future__ import annotations

import argparse
import logging
import sys

from client import (backend_dir, bench_compare, bench_dynamic, bench_levels, bench_offline, bench_profile,
                    bench_serve, bench_vllm, launcher, triton_client)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nightdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    launcher.add_serve_parser(sub)
    backend_dir.add_install_parser(sub)
    triton_client.add_complete_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that write JSON and print a table")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_offline.add_offline_parser(bench_sub)
    bench_compare.add_compare_parser(bench_sub)
    bench_dynamic.add_dynamic_parser(bench_sub)
    bench_levels.add_levels_parser(bench_sub)
    bench_serve.add_bench_serve_parser(bench_sub)
    bench_vllm.add_vllm_parser(bench_sub)
    bench_profile.add_profile_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError) as e:
        print(f"nightdraft: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
