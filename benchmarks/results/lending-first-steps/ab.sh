#!/bin/bash
# The server A/Bs of README.md: with lending_first_steps.diff (or lending_prompts.diff) applied to
# the working tree, three runs a side in turns, the files it changes stashed for each `base` run
# and restored after.
#   git apply benchmarks/results/lending-first-steps/lending_first_steps.diff
#   benchmarks/results/lending-first-steps/ab.sh OUT_DIR
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=${1:?an output folder}
mkdir -p "$OUT"
for i in 1 2 3; do
  for side in base new; do
    if [ $side = base ]; then git stash push -q backend/engine/core_lending.py backend/engine/adaptive.py planner/planner.py; fi
    .venv/bin/nightdraft bench levels --paths server --concurrency 4,16 --configs ar-1dev,psd,auto \
      --repeats 2 --pa-window-s 3 --json "$OUT/$side-$i.json" > "$OUT/$side-$i.log" 2>&1 || true
    if [ $side = base ]; then git stash pop -q; fi
    grep -E "^server" "$OUT/$side-$i.log" | sed "s/^/$side $i: /"
  done
done
