#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck, racecheck and initcheck over the case scripts, which drive
# every CUDA kernel path on small edge cases: scripts/sanitize_cases.py (permute, unpermute and
# their backward kernels), scripts/sanitize_gemm_cases.py (the grouped GEMM; sm_90 only),
# scripts/sanitize_decode_mlp_cases.py (the fused decode MLP; sm_90 only),
# scripts/sanitize_router_cases.py (route_tokens' fused router; sm_90 only),
# scripts/sanitize_gather_gemm_cases.py (the fused gather + first grouped GEMM; sm_90 only) and
# scripts/sanitize_down_backward_cases.py (the d lhs GEMM with the activation's backward; sm_90 only).
# Needs a CUDA GPU and the package installed.
# Usage: scripts/sanitize.sh [LOG_DIR [CASES...]]   (default /tmp and every case script; one
# sanitizer-<cases>-<tool>.log per case script and tool; SANITIZE_TOOLS="memcheck initcheck"
# runs only those tools). SCRIPT:A,B passes the script the arguments A B (a script that takes
# them runs only those cases, e.g. sanitize_router_cases:route5; its logs are named -A_B-).
# Prints one summary line per case script and tool; exits non-zero if any tool reports an error
# or the cases do not finish.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log_dir="$(mkdir -p "${1:-/tmp}" && cd "${1:-/tmp}" && pwd)"
shift || true
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(sanitize_cases sanitize_gemm_cases sanitize_decode_mlp_cases sanitize_router_cases
                             sanitize_gather_gemm_cases sanitize_down_backward_cases)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

# run_tool CASE TOOL LOG [compute-sanitizer options...] [-- case script arguments...]
run_tool() {
  local case=$1 tool=$2 log=$3
  shift 3
  local opts=() args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  [ $# -gt 0 ] && shift && args=("$@")
  # application-only: the python process, not the compiler processes XLA starts (with those the tool
  # crashed at random points of the router cases, each case at least once in some run).
  (cd /tmp && compute-sanitizer --tool "$tool" "${opts[@]}" --target-processes application-only --error-exitcode 99 \
     python3 "$here/$case.py" "${args[@]}") >"$log" 2>&1
  local rc=$?
  echo "$case $tool${args:+ (${args[*]})}: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  grep -q "CASES DONE" "$log" || { echo "$case $tool: the cases did not finish"; tail -5 "$log"; status=1; }
  [ "$rc" -eq 0 ] || status=1
}

for entry in "${cases[@]}"; do
  case=${entry%%:*}
  selected=()
  [ "$entry" = "$case" ] || IFS=, read -ra selected <<<"${entry#*:}"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
    log="$log_dir/sanitizer-$case${selected[*]:+-$(IFS=_; echo "${selected[*]}")}-$tool.log"
    # racecheck checks only the kernels under test, not XLA's reference GEMMs (with them it runs for
    # many minutes). On the GEMM cases it checks CUTLASS's kernel alone: instrumenting our small
    # setup and zero-fill kernels, or our persistent dW kernel, stops the tool at once with an
    # internal error (docs/grouped-gemm.md, "Sanitizers"; SANITIZE_RACECHECK_DW=1 tries the latter).
    if [ "$tool" = racecheck ] && [ "$case" = sanitize_gemm_cases ]; then
      cutlass_tiles=$(cd /tmp && python3 -c "from jax_moe_permute.grouped_gemm import TILES; print(' '.join(TILES))")
      # shellcheck disable=SC2086
      run_tool "$case" "$tool" "$log" --kernel-name kns=device_kernel -- $cutlass_tiles
      if [ "${SANITIZE_RACECHECK_DW:-0}" = 1 ]; then
        run_tool "$case" "$tool" "$log_dir/sanitizer-$case-$tool-dw.log" --kernel-name kns=grouped_wgrad -- dw:persistent-tma dw:persistent-registers
      fi
    elif [ "$tool" = racecheck ]; then
      run_tool "$case" "$tool" "$log" --kernel-name kns=moe -- "${selected[@]}"
    else
      run_tool "$case" "$tool" "$log" -- "${selected[@]}"
    fi
  done
done
exit $status
