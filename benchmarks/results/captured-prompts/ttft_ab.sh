# Time to first token, two checkouts in turns: four rounds, plain decoding and fixed SD each
# in a process of its own, the order of the sides alternating by round.
#
#   BASE=/path/to/checkout NEW=/path/to/checkout PY=/path/to/python \
#       benchmarks/results/captured-prompts/ttft_ab.sh OUT_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "$1" && cd "$1" && pwd)"
for n in 1 2 3 4; do
  if [ $((n % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for m in ar sd; do
    for side in $order; do
      dir=$BASE; [ "$side" = new ] && dir=$NEW
      (cd "$dir" && PYTHONPATH=$PWD "$PY" "$here/ttft.py" "$out/$side-$m-$n.json" $m > "$out/$side-$m-$n.log" 2>&1)
    done
  done
  echo "round $n $(date +%T)"
done
