#!/usr/bin/env bash
# `make test`: the whole suite as two pytest processes side by side, each writing its own log.
#
# On 2 cores one pytest keeps ~1 core busy: much of the suite waits (Ray and Dagster start-up,
# subprocess imports, daemon ticks, lock TTLs), so two halves in parallel finish in about
# two thirds of the time, and every test runs beside a loaded neighbour, as it will on CI some day.
# The halves are balanced by measured time (`--durations`) and keep tests/core and tests/explorer
# apart (each has its own conftest). With arguments, one pytest runs just those: `make test
# PYTEST_ARGS=tests/core/shards/test_mds.py`. Which tests cost the time, in CPU-seconds each (their Ray and
# Dagster processes included): scripts/suite_cpu.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest)
# Ray, Lance and Dagster each hold many descriptors, and a default soft limit is often 1,024: raise
# it to the hard limit (at most 65,536), as Ray's own docs ask. A leak still shows: tests/conftest.py
# releases what mosaicml-streaming would otherwise hold until exit.
hard=$(ulimit -Hn)
{ [ "$hard" = unlimited ] || [ "$hard" -gt 65536 ]; } && hard=65536
[ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$hard" ] && ulimit -n "$hard"
if [ "$#" -gt 0 ]; then
    exec "${PYTEST[@]}" "$@"
fi

# Half A is two pytest runs in a row: tests/core keeps one 1-CPU Ray for the modules that ask for it,
# tests/assets one 2-CPU Ray for its session, and in one process the second would find the first
# running and reuse it. (Helpers live in named modules, never `from conftest import`: any folders
# may share a run; tests/core/test_layout.py holds it.)
# e2e modules run in half A, after tests/assets, so the halves end within ~2 min of each other (measured on
# 2026-12-05 with --durations=0: half A 32 min, half B 37 min before test_build_stale/_report/_interrupt moved)
HEAVY_E2E=(tests/e2e/test_cluster.py tests/e2e/test_build_stale.py tests/e2e/test_build_report.py
           tests/e2e/test_build_interrupt.py)
GROUP_A1=(tests/core)
GROUP_A2=(tests/assets tests/deploy "${HEAVY_E2E[@]}")
GROUP_B=(tests/benchmarks tests/e2e tests/explorer)
for path in "${HEAVY_E2E[@]}"; do GROUP_B+=("--ignore=$path"); done

LOGS=test-artifacts/suite
mkdir -p "$LOGS"
started=$(date +%s)
# How busy the machine's CPUs were while the suite ran (every 5 s, from /proc/stat): whether the wall
# time is CPU work (then only less work helps) or waiting (then more halves would), in cpu.log.
cpu_busy() { read -r _ u n s i w q sq st _ < /proc/stat; echo $((u + n + s + q + sq + st)) $((i + w)); }
{ read -r b0 i0 < <(cpu_busy)
  while sleep 5; do read -r b1 i1 < <(cpu_busy)
    echo "$(date +%s) $(( 100 * (b1 - b0) / (b1 - b0 + i1 - i0 + 1) ))"; b0=$b1; i0=$i1; done; } > "$LOGS/cpu.log" &
sampler=$!
echo "[test] two halves in parallel; half A's log: $LOGS/a.log (printed when it ends), half B below"
{ "${PYTEST[@]}" "${GROUP_A1[@]}"; first=$?; "${PYTEST[@]}" "${GROUP_A2[@]}"; second=$?
  [ "$first" = 0 ] && [ "$second" = 0 ]; } > "$LOGS/a.log" 2>&1 &
a_pid=$!
"${PYTEST[@]}" "${GROUP_B[@]}" 2>&1 | tee "$LOGS/b.log"
b_status=${PIPESTATUS[0]}
wait "$a_pid"
a_status=$?
echo; echo "[test] ===== half A (${GROUP_A1[*]}, then ${GROUP_A2[*]}) ====="
if grep -q "= FAILURES =\|= ERRORS =" "$LOGS/a.log"; then
    sed -n '/= FAILURES =\|= ERRORS =/,$p' "$LOGS/a.log"
else
    grep -E "^=+ .*(passed|failed|error).* in [0-9.]+s" "$LOGS/a.log" || tail -n 60 "$LOGS/a.log"
fi
kill "$sampler" 2>/dev/null
busy=$(awk '{ t += $2; n++ } END { if (n) printf "%d", t / n; else printf "?" }' "$LOGS/cpu.log")
echo "[test] half A exit $a_status, half B exit $b_status, $(( ($(date +%s) - started) / 60 )) min in all," \
     "CPUs ${busy}% busy on average ($LOGS/cpu.log)"
[ "$a_status" = 0 ] && [ "$b_status" = 0 ]
