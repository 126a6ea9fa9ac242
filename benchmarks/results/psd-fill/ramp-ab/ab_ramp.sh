#!/bin/bash
# A/B: the PSD fill priced apart (/work/main) or in PSD's mean (/tmp/nofill), ramp through the server, fixed capacity
set -e
for i in 1 2; do
  for side in fill nofill; do
    tree=/work/main; [ $side = nofill ] && tree=/tmp/nofill
    echo "== $side $i $(date -u +%H:%M:%S)"
    (cd $tree && /work/main/.venv/bin/python -m client.cli bench dynamic --server --shape ramp --scale 0.3 --repeats 1 --configs ar,adaptive --capacity 17.33 --json /tmp/ab/ramp-$side-$i.json 2>&1 | grep -E "^goals, adaptive:|^adaptive  +1.3x|^ar  +1.3x|^adaptive +overall|^ar +overall")
  done
done
