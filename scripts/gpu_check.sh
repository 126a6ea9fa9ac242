#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, run the GPU tests (pytest -m gpu) and a short
# offline benchmark of the decoding modes (AR vs SD vs PSD vs adaptive, whichever
# `nightdraft bench offline --mode` offers) with the drafter colocated in the target's process,
# as a second process on the same GPU, and on a second GPU when there is one. Every run writes
# JSON under the output folder; summary.json and a table compare them. Finishes within 10 minutes
# (--budget-s, default 540 s, bounds tests and benchmarks together; each step has its own timeout).
#
#   scripts/gpu_check.sh [--dry-run] [--out DIR] [--target DIR] [--drafter DIR] [--gpus N]
#                        [--concurrency "1 16"] [--num-prompts N] [--max-tokens N]
#                        [--dtype bfloat16|float16|float32] [--budget-s S] [--skip-tests] [--skip-bench]
#                        [--skip-tp]
#
# Then a tensor-parallel check (scripts/tp_throughput.py): the target at TP 2 against TP 1, greedy
# outputs equal (float32) and throughput at concurrency 1 and 16; the two ranks share cuda:0 on a
# one-GPU host (all-reduces over gloo: a correctness check, not a speed-up), else cuda:0 and cuda:1
# (NCCL). Skip it with --skip-tp.
#
# With --dry-run, or when no NVIDIA GPU is found, it validates its inputs (checkpoints, the CLI's
# options, numbers) and prints the commands it would run, then exits 0 (2 on invalid input).
# PYTHON (default .venv/bin/python, else python3) and NIGHTDRAFT (default .venv/bin/nightdraft,
# else "$PYTHON -m client.cli") name the interpreter and the CLI to use.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

dry_run=0
out=""
target="$ROOT/models/tiny-target"
drafter="$ROOT/models/tiny-drafter"
gpus=""
concurrency="1 16"
num_prompts=32
max_tokens=64
dtype="bfloat16"
budget_s=540
skip_tests=0
skip_bench=0
skip_tp=0

die() { echo "gpu_check: error: $*" >&2; exit 2; }
note() { echo "gpu_check: $*" >&2; }
usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --out) out="${2:?--out needs a folder}"; shift ;;
        --target) target="${2:?--target needs a checkpoint folder}"; shift ;;
        --drafter) drafter="${2:?--drafter needs a checkpoint folder}"; shift ;;
        --gpus) gpus="${2:?--gpus needs a number}"; shift ;;
        --concurrency) concurrency="${2:?--concurrency needs numbers}"; shift ;;
        --num-prompts) num_prompts="${2:?}"; shift ;;
        --max-tokens) max_tokens="${2:?}"; shift ;;
        --dtype) dtype="${2:?}"; shift ;;
        --budget-s) budget_s="${2:?}"; shift ;;
        --skip-tests) skip_tests=1 ;;
        --skip-bench) skip_bench=1 ;;
        --skip-tp) skip_tp=1 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

# ---------------------------------------------------------------- validate inputs

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
need_int() {  # option value min max
    if ! is_uint "$2" || (( $2 < $3 || $2 > $4 )); then die "$1 must be an integer in [$3, $4], got '$2'"; fi
}
need_int --num-prompts "$num_prompts" 1 100000
need_int --max-tokens "$max_tokens" 1 100000
need_int --budget-s "$budget_s" 60 600
[[ -z "$gpus" ]] || need_int --gpus "$gpus" 1 64
case "$dtype" in float32|bfloat16|float16) ;; *) die "--dtype must be float32, bfloat16 or float16, got '$dtype'" ;; esac
read -r -a concs <<<"$concurrency"
(( ${#concs[@]} >= 1 )) || die "--concurrency needs at least one number"
for c in "${concs[@]}"; do need_int --concurrency "$c" 1 4096; done
for ck in "$target" "$drafter"; do
    [[ -f "$ck/config.json" ]] || die "no checkpoint at '$ck' (config.json missing); make the tiny pair with 'make tiny-models' or pass --target/--drafter"
done
[[ -z "$out" || ! -e "$out" || -d "$out" ]] || die "--out '$out' exists and is not a folder"
[[ -n "$out" ]] || out="$ROOT/out/gpu-check-$(date +%Y%m%d-%H%M%S)"

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi
if [[ -z "$PYTHON" ]] || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    die "no Python >= 3.10 (set PYTHON, or run 'make install' for .venv)"
fi
if [[ -n "${NIGHTDRAFT:-}" ]]; then
    read -r -a cli <<<"$NIGHTDRAFT"
elif [[ -x "$ROOT/.venv/bin/nightdraft" ]]; then
    cli=("$ROOT/.venv/bin/nightdraft")
else
    cli=("$PYTHON" -m client.cli)
fi

# What `nightdraft bench offline` offers: its --mode choices and whether it places the drafter.
help_text="$("${cli[@]}" bench offline --help 2>&1)" \
    || die "'${cli[*]} bench offline --help' failed:
$help_text"
for opt in --mode --device --dtype --json --concurrency --num-prompts --max-tokens --target --drafter; do
    grep -q -- "$opt" <<<"$help_text" || die "'nightdraft bench offline' has no $opt option"
done
mode_choices="$(grep -o -- '--mode {[^}]*}' <<<"$help_text" | head -n 1 | sed 's/.*{\(.*\)}/\1/')"
[[ -n "$mode_choices" ]] || die "could not read the --mode choices of 'nightdraft bench offline'"
IFS=',' read -r -a offered <<<"$mode_choices"
has_mode() { local m; for m in "${offered[@]}"; do [[ "$m" == "$1" ]] && return 0; done; return 1; }
has_mode ar || die "'nightdraft bench offline --mode' does not offer ar (offers: $mode_choices)"
has_drafter_device=0
grep -q -- '--drafter-device' <<<"$help_text" && has_drafter_device=1

# ---------------------------------------------------------------- find the GPU

gpu_found=0
gpu_why=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
    gpu_why="nvidia-smi not found"
elif ! gpu_list="$(nvidia-smi -L 2>&1)" || [[ -z "$gpu_list" ]]; then
    gpu_why="nvidia-smi lists no GPU: ${gpu_list:-}"
elif ! torch_gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>&1)" \
        || ! is_uint "$torch_gpus" || (( torch_gpus == 0 )); then
    gpu_why="torch in $PYTHON sees no CUDA device (a CPU build of torch?): ${torch_gpus:-}"
else
    gpu_found=1
    [[ -n "$gpus" ]] || gpus="$torch_gpus"
fi
if (( ! gpu_found )); then
    (( dry_run )) || note "no NVIDIA GPU found ($gpu_why): dry run"
    dry_run=1
    [[ -n "$gpus" ]] || gpus=2   # show every placement
fi

# ---------------------------------------------------------------- the plan

budget_end=$(( SECONDS + budget_s ))
test_timeout=$(( budget_s * 2 / 5 ))

test_cmd=(timeout --kill-after=10 "$test_timeout" "$PYTHON" -m pytest -m gpu -q -ra -p no:cacheprovider
          "--junitxml=$out/gpu-tests.xml" tests)

# name | mode | drafter device ("" = in the target's process)
runs=()
runs+=("ar|ar|")
if has_mode sd; then
    runs+=("sd-colocated|sd|")
    (( has_drafter_device )) && runs+=("sd-proc-cuda0|sd|cuda:0")
    (( has_drafter_device && gpus >= 2 )) && runs+=("sd-proc-cuda1|sd|cuda:1")
fi
if has_mode psd; then
    if (( has_drafter_device )); then
        runs+=("psd-proc-cuda0|psd|cuda:0")
        (( gpus >= 2 )) && runs+=("psd-proc-cuda1|psd|cuda:1")
    else
        runs+=("psd|psd|")
    fi
fi
if has_mode auto; then
    if (( has_drafter_device )); then
        if (( gpus >= 2 )); then runs+=("auto-proc-cuda1|auto|cuda:1"); else runs+=("auto-proc-cuda0|auto|cuda:0"); fi
    else
        runs+=("auto|auto|")
    fi
fi

bench_cmd() {  # conc name mode drafter_device -> the command in BENCH
    local conc="$1" name="$2" mode="$3" ddev="$4" n="$num_prompts"
    (( conc == 1 && n > 8 )) && n=8   # one at a time: fewer prompts keep the run short
    BENCH=("${cli[@]}" bench offline --mode "$mode" --device cuda --dtype "$dtype"
           --target "$target" --drafter "$drafter" --num-prompts "$n" --max-tokens "$max_tokens"
           --concurrency "$conc" --json "$out/offline-c${conc}-${name}.json")
    [[ -n "$ddev" ]] && BENCH+=(--drafter-device "$ddev")
    return 0
}

show() { printf '+'; printf ' %q' "$@"; printf '\n'; }

tp_cmd() {  # the tensor-parallel check in TP
    local devices="cuda:0,cuda:0"
    (( gpus >= 2 )) && devices="cuda:0,cuda:1"
    TP=("$PYTHON" scripts/tp_throughput.py --device cuda --dtype float32 --target "$target"
        --tensor-parallel-size 2 --tensor-parallel-devices "$devices" --concurrency "1 16"
        --num-prompts 16 --max-tokens 32 --reps 1 --out "$out/tp.json")
}

echo "gpu_check: python $PYTHON; cli ${cli[*]}"
echo "gpu_check: modes offered: $mode_choices; drafter placement option: $( ((has_drafter_device)) && echo yes || echo no)"
echo "gpu_check: GPUs: $gpus$( ((gpu_found)) || echo " (assumed; $gpu_why)"); budget ${budget_s}s; output $out"
echo "gpu_check: checkpoints: target $target, drafter $drafter"

if (( dry_run )); then
    echo "gpu_check: dry run, would run:"
    show mkdir -p "$out"
    (( skip_tests )) || show "${test_cmd[@]}"
    if (( ! skip_bench )); then
        for conc in "${concs[@]}"; do
            for r in "${runs[@]}"; do
                IFS='|' read -r name mode ddev <<<"$r"
                bench_cmd "$conc" "$name" "$mode" "$ddev"
                show timeout --kill-after=10 150 "${BENCH[@]}"
            done
        done
        echo "  (each benchmark's timeout: what is left of the budget, at most 150 s; then summary.json and a table)"
    fi
    if (( ! skip_tp )); then
        tp_cmd
        show timeout --kill-after=10 150 "${TP[@]}"
    fi
    echo "gpu_check: dry run OK (${#runs[@]} configurations x ${#concs[@]} concurrencies)"
    exit 0
fi

# ---------------------------------------------------------------- run

mkdir -p "$out" || die "cannot create $out"
failures=()
{
    nvidia-smi
    "$PYTHON" -c 'import json, torch; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))'
} >"$out/env.txt" 2>&1

if (( ! skip_tests )); then
    echo "gpu_check: GPU tests (timeout ${test_timeout}s)"
    show "${test_cmd[@]}"
    "${test_cmd[@]}" 2>&1 | tee "$out/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    # 5 = no test collected for -m gpu: say so, it is not a failure of the GPU path.
    if (( rc == 5 )); then note "no GPU tests collected"; elif (( rc != 0 )); then failures+=("gpu tests (exit $rc)"); fi
fi

if (( ! skip_bench )); then
    for conc in "${concs[@]}"; do
        for r in "${runs[@]}"; do
            IFS='|' read -r name mode ddev <<<"$r"
            left=$(( budget_end - SECONDS ))
            if (( left < 20 )); then
                note "budget spent: skipping c${conc} ${name}"
                failures+=("c${conc} ${name} (skipped: budget)")
                continue
            fi
            (( left > 150 )) && left=150
            bench_cmd "$conc" "$name" "$mode" "$ddev"
            show timeout --kill-after=10 "$left" "${BENCH[@]}"
            timeout --kill-after=10 "$left" "${BENCH[@]}" >"$out/offline-c${conc}-${name}.log" 2>&1
            rc=$?
            tail -n 1 "$out/offline-c${conc}-${name}.log"
            (( rc == 0 )) || failures+=("c${conc} ${name} (exit $rc, see offline-c${conc}-${name}.log)")
        done
    done
    "$PYTHON" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for f in sorted(out.glob("offline-c*.json")):
    r = json.loads(f.read_text())
    r.pop("outputs", None)
    r["run"] = f.stem.removeprefix("offline-")
    rows.append(r)
ar = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["run"].endswith("-ar")}
for r in rows:
    base = ar.get(r["concurrency"])
    r["speedup_vs_ar"] = r["tokens_per_s"] / base if base else None
(out / "summary.json").write_text(json.dumps(rows, indent=1))
print(f"{'run':<22}{'tok/s':>10}{'vs AR':>8}{'accept':>8}{'tok/call':>9}{'step ms':>9}")
for r in rows:
    sp = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
    print(f"{r['run']:<22}{r['tokens_per_s']:>10.1f}{sp:>8}{r.get('acceptance_rate', 0):>8.3f}"
          f"{r.get('mean_tokens_per_target_call', 0):>9.2f}{1000 * r.get('mean_step_s', 0):>9.2f}")
print(f"wrote {out / 'summary.json'}")
PY
fi

if (( ! skip_tp )); then
    left=$(( budget_end - SECONDS ))
    if (( left < 30 )); then
        note "budget spent: skipping the tensor-parallel check"
        failures+=("tp2 (skipped: budget)")
    else
        (( left > 150 )) && left=150
        tp_cmd
        echo "gpu_check: tensor-parallel check (TP 2 against TP 1)"
        show timeout --kill-after=10 "$left" "${TP[@]}"
        timeout --kill-after=10 "$left" "${TP[@]}" >"$out/tp.log" 2>&1
        rc=$?
        grep -E "^(concurrency|wrote)" "$out/tp.log"
        (( rc == 0 )) || failures+=("tp2 (exit $rc, see tp.log)")
    fi
fi

if (( ${#failures[@]} )); then
    note "FAILED: ${failures[*]}"
    exit 1
fi
echo "gpu_check: all passed; results in $out"
