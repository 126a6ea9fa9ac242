#!/usr/bin/env bash
# The planner's promise, measured: `bench levels` (auto beside plain decoding on one core and on
# every core, SD and PSD, concurrency 1-64, in process and through tritonserver with
# perf_analyzer), then `bench dynamic --server` under bursty and mixed load. Run it on a quiet
# machine: every figure is a ratio of runs interleaved in one command, but a busy neighbour
# still widens the spread. Results land in benchmarks/results/ (or $OUT).
#
#   scripts/measure_promise.sh [levels] [dynamic-bursty] [dynamic-mixed] ...   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
ND=.venv/bin/nightdraft
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(levels dynamic-bursty dynamic-mixed)
for part in "${parts[@]}"; do
  echo "== $part ($(date -u +%H:%M:%S))" >&2
  case "$part" in
    levels)
      $ND bench levels --concurrency 1,4,16,64 --repeats 2 --pa-window-s 3 --json "$OUT/levels.json" ;;
    dynamic-in-process-*)
      shape="${part#dynamic-in-process-}"
      $ND bench dynamic --shape "$shape" --scale 0.3 --repeats 2 --json "$OUT/dynamic-$shape.json" ;;
    dynamic-*)
      shape="${part#dynamic-}"
      $ND bench dynamic --server --shape "$shape" --scale 0.3 --repeats 2 \
        --json "$OUT/dynamic-server-$shape.json" ;;
    *) echo "measure_promise.sh: unknown part $part" >&2; exit 2 ;;
  esac
done
