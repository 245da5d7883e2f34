#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck, racecheck and initcheck over scripts/sanitize_cases.py, which
# drives every CUDA kernel path on small edge cases. Needs a CUDA GPU and the package installed.
# Usage: scripts/sanitize.sh [LOG_DIR]   (default /tmp; one sanitizer-<tool>.log per tool)
# Prints one summary line per tool; exits non-zero if any tool reports an error or the cases
# do not finish.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log_dir="$(mkdir -p "${1:-/tmp}" && cd "${1:-/tmp}" && pwd)"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for tool in memcheck racecheck initcheck; do
  log="$log_dir/sanitizer-$tool.log"
  (cd /tmp && compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 99 \
     python3 "$here/sanitize_cases.py") >"$log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  grep -q "SANITIZE CASES DONE" "$log" || { echo "$tool: the cases did not finish"; tail -5 "$log"; status=1; }
  [ "$rc" -eq 0 ] || status=1
done
exit $status
