#!/usr/bin/env bash
# Drive the nightdraft model with Triton's perf_analyzer (streaming, gRPC) and summarise the
# profile export as TTFT / ITL / TPOT / e2e.
#
#   scripts/perf_analyzer.sh [-u HOST:GRPC_PORT] [-m MODEL] [-c CONCURRENCY_RANGE] [-n MAX_TOKENS]
#                            [-t TEMPERATURE] [-o EXPORT.json] [-- more perf_analyzer args]
#   eval "$(scripts/perf_analyzer.sh --env)"   # only set PATH/LD_LIBRARY_PATH for perf_analyzer
#                                              # (e.g. for genai-perf, which calls it)
#
# Defaults: -u localhost:8001 -m nightdraft -c 1 -n 64 -t 1.0 -o out/perf_analyzer.json,
# measurement: 3 windows of 10 s at most (override after --, e.g. -- --measurement-interval 20000).
#
# The perf_analyzer binary: $PERF_ANALYZER, else perf_analyzer on PATH, else the one the
# tritonclient==2.51.0 wheel bundles (.venv/bin/perf_analyzer). That binary needs libb64.so.0d and
# libcudart.so.12 (even on a CPU-only host); the nvidia-pytriton wheel carries both under
# renamed files, so this script links them into a private library directory.
# See docs in model_repository/README.md for the genai-perf recipe.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

URL=localhost:8001 MODEL=nightdraft CONC=1 MAXTOK=64 TEMP=1.0 EXPORT="$ROOT/out/perf_analyzer.json"
ENV_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    -u) URL="$2"; shift 2 ;;
    -m) MODEL="$2"; shift 2 ;;
    -c) CONC="$2"; shift 2 ;;
    -n) MAXTOK="$2"; shift 2 ;;
    -t) TEMP="$2"; shift 2 ;;
    -o) EXPORT="$2"; shift 2 ;;
    --env) ENV_ONLY=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) echo "perf_analyzer.sh: unknown argument $1 (see -h)" >&2; exit 2 ;;
  esac
done

PA="${PERF_ANALYZER:-}"
[ -n "$PA" ] || PA="$(command -v perf_analyzer || true)"
[ -n "$PA" ] || PA="$(dirname "$PY")/perf_analyzer"
if [ ! -x "$PA" ]; then
  echo "perf_analyzer.sh: no perf_analyzer binary (pip install tritonclient[all]==2.51.0, or set PERF_ANALYZER)" >&2
  exit 3
fi

# Missing shared libraries -> link the pytriton wheel's copies under their expected names.
LIBDIR="${XDG_CACHE_HOME:-$HOME/.cache}/nightdraft/perf_analyzer_libs"
LDD_OUT="$(ldd "$PA" 2>/dev/null || true)"
if [[ "$LDD_OUT" == *"not found"* ]]; then
  PYLIBS="$("$PY" - <<'PYEOF' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("pytriton")
if spec and spec.submodule_search_locations:
    print(pathlib.Path(list(spec.submodule_search_locations)[0]).parent / "nvidia_pytriton.libs")
PYEOF
)"
  mkdir -p "$LIBDIR"
  for pair in "libb64.so.0d:libb64-*.so.0d" "libcudart.so.12:libcudart-*.so.12*"; do
    want="${pair%%:*}" pattern="${pair#*:}"
    if [ -n "$PYLIBS" ] && [ -d "$PYLIBS" ]; then
      src="$(ls "$PYLIBS"/$pattern 2>/dev/null | head -n1 || true)"
      if [ -n "$src" ]; then ln -sf "$src" "$LIBDIR/$want"; fi
    fi
  done
  export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  LDD_OUT="$(ldd "$PA" 2>/dev/null || true)"
  if [[ "$LDD_OUT" == *"not found"* ]]; then
    grep "not found" <<<"$LDD_OUT" >&2
    echo "perf_analyzer.sh: $PA cannot run here (libraries above are missing)" >&2
    exit 3
  fi
fi

if [ "$ENV_ONLY" = 1 ]; then
  echo "export PATH=\"$(dirname "$PA"):\$PATH\""
  echo "export LD_LIBRARY_PATH=\"${LD_LIBRARY_PATH:-}\""
  exit 0
fi

# Input data: a few prompts, the vLLM-backend schema (genai-perf's --backend vllm sends the same).
mkdir -p "$(dirname "$EXPORT")"
# perf_analyzer refuses an export path that exists ("Path must not already exist") and prints its
# whole usage: a rerun with the same -o (the default's too) replaces the previous run's export
rm -f "$EXPORT"
DATA="$(dirname "$EXPORT")/perf_analyzer_input.json"
"$PY" - "$DATA" "$MODEL" "$MAXTOK" "$TEMP" "$ROOT" <<'PYEOF'
import json, sys
sys.path.insert(0, sys.argv[5])
out, model, maxtok, temp = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
try:
    from client.prompts import load_prompts
    prompts = load_prompts(n=16)
except Exception:
    prompts = ["def fibonacci(n):\n", "import os\n\nclass Config:\n", "for i in range(10):\n"]
rows = []
for p in prompts:
    if model == "ensemble":
        rows.append({"text_input": [p], "stream": [True], "max_tokens": [maxtok], "temperature": [temp]})
    else:
        sp = {"max_tokens": str(maxtok), "temperature": str(temp), "ignore_eos": "true"}
        rows.append({"text_input": [p], "stream": [True], "exclude_input_in_output": [True],
                     "sampling_parameters": [json.dumps(sp)]})
json.dump({"data": rows}, open(out, "w"))
PYEOF

set -x
rc=0
"$PA" -m "$MODEL" -i grpc -u "$URL" --streaming --input-data "$DATA" \
  --concurrency-range "$CONC" --measurement-interval 10000 --max-trials 3 --stability-percentage 50 \
  --profile-export-file "$EXPORT" "$@" || rc=$?
set +x
if [ -s "$EXPORT" ]; then
  # perf_analyzer 2.51 has been seen to leave a large export cut off (at 128 KiB) and still exit 0:
  # the measurement stands, only its summary is lost
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m client.bench_serve --perf-analyzer-export "$EXPORT" \
    || echo "perf_analyzer.sh: could not summarise $EXPORT (cut off?); perf_analyzer's own output above stands" >&2
elif [ "$rc" = 0 ]; then
  # also seen once from 2.51 on a busy host: a measurement printed, exit 0, and no export
  echo "perf_analyzer.sh: perf_analyzer wrote no profile export at $EXPORT; its own output above stands" >&2
fi
if [ "$rc" != 0 ]; then
  echo "perf_analyzer.sh: perf_analyzer exited with $rc (an unstable measurement on a busy host: add" \
       "-- --stability-percentage 999, or a longer --measurement-interval)" >&2
fi
exit "$rc"
