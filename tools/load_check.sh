#!/usr/bin/env bash
# Run tests while a CPU burner keeps every core busy: no test may depend on an idle machine.
#
#   tools/load_check.sh                                   # the unit tests (make test-unit's selection)
#   tools/load_check.sh tests/test_serving.py -k break --count 50   # any pytest arguments (--count: pytest-repeat)
#
# One busy loop per core (nproc), started here and ended by PID when pytest returns, however it returns.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
cores=$(nproc)
burners=()
stop_burners() {
    kill "${burners[@]}" 2>/dev/null
    wait "${burners[@]}" 2>/dev/null
}
trap stop_burners EXIT
for _ in $(seq "$cores"); do
    "$PY" -c "while True: pass" &
    burners+=($!)
done
[ $# -gt 0 ] || set -- tests -m "not browser"
start=$(date +%s)
"$PY" -m pytest "$@"
status=$?
echo "load_check: pytest $* -> exit $status in $(($(date +%s) - start)) s, with $cores busy loop(s) on $cores core(s)"
exit $status
