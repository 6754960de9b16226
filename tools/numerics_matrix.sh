#!/usr/bin/env bash
# The suite under the CPU configurations of CONTRIBUTING.md's "Platforms", one pass/fail line per configuration:
# the instruction sets of oneDNN, MKL, ATen and OpenBLAS (numpy's, the Triton interpreter's products) limited to AVX2
# or left to the CPU, on 1 and 4 threads, and "compat": every library on its most generic code path (a CPU unlike
# this one: it sums in other orders than all the others). No make, no install: it runs the venv that is there.
#
#   tools/numerics_matrix.sh                     # the unit tests (tests/, but the browser ones), in each configuration
#   tools/numerics_matrix.sh --notebooks         # the notebooks under nbval too (a full run: an hour or more)
#   tools/numerics_matrix.sh tests/test_layers.py notebooks/04_layers.ipynb   # these only (notebooks run under nbval)
#   CONFIGS="avx2-1 native-4" tools/numerics_matrix.sh                        # some configurations only
#
# Waiting threads sleep (OMP_WAIT_POLICY=PASSIVE: more spinning threads than cores slow a run; the sums do not
# change). Each run's output goes to $LOGS (default: a new folder under /tmp), named after its configuration. Exit
# status: the number of failed runs. Running the notebooks rewrites a few figures under figures/ (`git checkout figures`).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOGS=${LOGS:-$(mktemp -d /tmp/numerics_matrix.XXXX)}
mkdir -p "$LOGS"

AVX2="ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell"
COMPAT="MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default OPENBLAS_CORETYPE=Prescott"
declare -A ENVS=(
  [avx2-1]="$AVX2 OMP_NUM_THREADS=1"
  [avx2-4]="$AVX2 OMP_NUM_THREADS=4"
  [native-1]="OMP_NUM_THREADS=1"
  [native-4]="OMP_NUM_THREADS=4"
  [compat-3]="$COMPAT OMP_NUM_THREADS=3"
)
CONFIGS=${CONFIGS:-"avx2-1 avx2-4 native-1 native-4 compat-3"}

tests=() notebooks=()
for arg in "$@"; do
  case "$arg" in
    --notebooks) notebooks=(notebooks/) ;;
    *.ipynb|notebooks|notebooks/) notebooks+=("$arg") ;;
    *) tests+=("$arg") ;;
  esac
done
[ $# -eq 0 ] || [ "$*" = --notebooks ] && tests=(tests)

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) | $(grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo \
  | sort -u | tr '\n' ' ')| logs in $LOGS"
for config in $CONFIGS; do echo "  $config: ${ENVS[$config]-?}"; done
failed=0
run() {   # run NAME CONFIG pytest-args...: one line, PASS or FAIL, with pytest's summary and the wall time
  local name=$1 config=$2 log="$LOGS/$1-$2.log" start=$SECONDS
  shift 2
  env OMP_WAIT_POLICY=PASSIVE ${ENVS[$config]} PYTHONPATH="$PWD" timeout 7200 "$PY" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  local rc=$? summary
  summary=$(grep -E '(passed|failed|error)' "$log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
  [ $rc -eq 0 ] && status=PASS || { status=FAIL; failed=$((failed + 1)); }
  printf '%s  %-9s %-8s %6ss  %s\n' "$status" "$name" "$config" $((SECONDS - start)) "${summary:-exit status $rc}"
}
for config in $CONFIGS; do
  [ -n "${ENVS[$config]+x}" ] || { echo "unknown configuration $config (known: ${!ENVS[*]})"; exit 99; }
  [ ${#tests[@]} -eq 0 ] || run tests "$config" -m "not browser" "${tests[@]}"
  [ ${#notebooks[@]} -eq 0 ] || run notebooks "$config" --nbval --nbval-current-env --nbval-cell-timeout=1800 \
    "${notebooks[@]}"
done
exit $failed
