#!/usr/bin/env bash
# Where the suite's time goes, in CPU-seconds per test: `bash scripts/suite_cpu.sh [OUT]` runs the two
# halves of scripts/test.sh (the same groups), each in a cgroup-v1 cpuacct group of its own, and writes
# OUT/a.tsv and OUT/b.tsv (CPU s, wall s, test) and OUT/totals. The suite is CPU-bound on 2 cores (each
# half keeps about one busy), so a test's CPU-seconds are what removing it saves. Needs a writable
# /sys/fs/cgroup/cpuacct (root on cgroup v1); a development tool, not part of `make test`.
# `bash scripts/suite_cpu.sh OUT PATH...` measures just those tests, as one pytest (OUT/a.tsv).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-test-artifacts/suite-cpu}")
acct=/sys/fs/cgroup/cpuacct
[ -w "$acct" ] || { echo "suite_cpu: $acct is not writable (cgroup v1 and root needed)" >&2; exit 2; }
mkdir -p "$out" && rm -f "$out"/*.tsv "$out"/totals
hard=$(ulimit -Hn); { [ "$hard" = unlimited ] || [ "$hard" -gt 65536 ]; } && hard=65536; ulimit -n "$hard"
eval "$(sed -n '/^HEAVY_E2E=/,/^for path in/p' scripts/test.sh)"  # GROUP_A1, GROUP_A2, GROUP_B as test.sh has them
PYTEST=(env PYTHONPATH=scripts .venv/bin/python -m pytest -p pytest_cpuacct -p no:cacheprovider)

in_group() {  # in_group NAME TSV CMD...: CMD inside cpuacct group NAME, its usage reset
    local name=$1 tsv=$2; shift 2
    mkdir -p "$acct/$name" && echo 0 > "$acct/$name/cpuacct.usage"
    ( echo "$BASHPID" > "$acct/$name/cgroup.procs"
      PRX_CPUACCT_GROUP=$name PRX_CPUACCT_OUT=$tsv exec "$@" )
}

started=$(date +%s)
if [ "$#" -gt 1 ]; then
    in_group prx-suite-a "$out/a.tsv" "${PYTEST[@]}" "${@:2}" > "$out/a.log" 2>&1
    echo "CPU: $(( $(cat "$acct/prx-suite-a/cpuacct.usage") / 1000000000 )) s, wall: $(( $(date +%s) - started )) s"
    sort -rn "$out/a.tsv" | head -20
    exit 0
fi
in_group prx-suite-a "$out/a.tsv" bash -c "$(printf '%q ' "${PYTEST[@]}" "${GROUP_A1[@]}"); $(printf '%q ' "${PYTEST[@]}" "${GROUP_A2[@]}")" \
    > "$out/a.log" 2>&1 &
in_group prx-suite-b "$out/b.tsv" "${PYTEST[@]}" "${GROUP_B[@]}" > "$out/b.log" 2>&1
wait
for half in a b; do
    echo "half $half: $(( $(cat "$acct/prx-suite-$half/cpuacct.usage") / 1000000000 )) CPU-s" >> "$out/totals"
done
echo "wall: $(( $(date +%s) - started )) s" >> "$out/totals"
cat "$out/totals"
echo "the 20 costliest tests (CPU s, wall s):"
sort -rn "$out"/a.tsv "$out"/b.tsv | head -20
