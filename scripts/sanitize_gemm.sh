#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck, racecheck and initcheck over scripts/sanitize_gemm_cases.py
# (the grouped GEMM behind ragged_dot) on an sm_90 machine, with the package installed. Prints one
# summary line per tool; exits non-zero if any tool reports an error.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for tool in memcheck racecheck initcheck; do
  log="${OUT:-/tmp}/sanitizer-gemm-$tool.log"
  (cd /tmp && compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 99 \
     python3 "$here/sanitize_gemm_cases.py") >"$log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  grep -q "SANITIZE GEMM CASES DONE" "$log" || { echo "$tool: the cases did not finish"; tail -5 "$log"; status=1; }
  [ "$rc" -eq 0 ] || status=1
done
exit $status
