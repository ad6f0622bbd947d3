#!/usr/bin/env bash
# Runs every GPU test family under each compute-sanitizer tool (memcheck, racecheck, initcheck,
# synccheck) and writes one log per (family, tool) plus a JSON summary:
#   scripts/sanitize_gpu.sh BUILD_DIR OUT_DIR
# The jobs run concurrently on the one GPU (SANITIZE_JOBS at a time, default 8): a sanitized run
# is bound by the host's instrumentation, not by the GPU. Each job has its own time limit
# (SANITIZE_TIMEOUT seconds, default 540); a job that runs out counts as not clean.
# The tests whose only purpose is the benchmark shapes (hundreds of MB per tensor) are left out:
# every kernel they launch also runs at the smaller shapes of the same family's other tests.
# SANITIZE_FAMILIES and SANITIZE_TOOLS narrow the run (names as below).
set -uo pipefail
build=${1:?build directory}
out=${2:?output directory}
mkdir -p "$out"
tests="$build/fusekit_tests"
[ -x "$tests" ] || { echo "sanitize_gpu: $tests not built" >&2; exit 1; }

declare -A filters=(
  [norm]="NormGpu.*"
  [bias_act_dropout]="BiasActDropoutGpu.*"
  [linear]="LinearGpu.*"
  [fp8_norm]="Fp8NormGpu.*"
  [attention]="AttentionGpu.*"
  [core]="PhiloxGpu.*:ActivationGpu.*:LaunchTuningGpu.*"
)
large="*BenchmarkShapes*:*LargerShapes*:*LongCausalSequence*"
families=${SANITIZE_FAMILIES:-"norm bias_act_dropout linear fp8_norm attention core"}
tools=${SANITIZE_TOOLS:-"memcheck racecheck initcheck synccheck"}

run_one() {
  local family=$1 tool=$2 filter=$3 log="$out/sanitize-$1-$2.log"
  local extra=()
  # synccheck tracks the TMA-ring mbarriers (cuda::barrier) only with a fixed per-block budget:
  # its automatic sizing overflows ("overflow of tracked cuda::barrier").
  [ "$tool" = synccheck ] && extra=(--num-cuda-barriers 4096)
  local start=$(date +%s)
  OMP_NUM_THREADS=2 timeout "${SANITIZE_TIMEOUT:-540}" compute-sanitizer --tool "$tool" \
    ${extra[@]+"${extra[@]}"} --error-exitcode 9 --print-limit 20 \
    "$tests" --gtest_filter="$filter-$large" >"$log" 2>&1
  local rc=$? secs=$(( $(date +%s) - start ))
  local summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)
  local gtest=$(grep -E '^\[  (PASSED|FAILED) ' "$log" | tr '\n' ' ')
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$family" "$tool" "$rc" "$secs" "$summary" "$gtest" >"$log.result"
}
export -f run_one
export out tests large SANITIZE_TIMEOUT

jobs=()
for family in $families; do
  for tool in $tools; do jobs+=("$family $tool ${filters[$family]}"); done
done
printf '%s\n' "${jobs[@]}" | xargs -P "${SANITIZE_JOBS:-8}" -L 1 bash -c 'run_one "$0" "$1" "$2"'

status=0
python3 - "$out" <<'PYEOF' || status=1
import glob, json, os, re, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(out, "sanitize-*.log.result"))):
    family, tool, rc, secs, summary, gtest = (open(path).read().rstrip("\n").split("\t") + [""] * 6)[:6]
    # "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)".
    m = re.search(r"\((\d+) errors", summary) or re.search(r"ERROR SUMMARY: (\d+) error", summary)
    errors = int(m.group(1)) if m else None
    passed = re.search(r"PASSED\s*\]\s+(\d+)", gtest)
    rows.append({"family": family, "tool": tool, "exit_code": int(rc), "seconds": int(secs),
                 "errors": errors, "summary": summary.strip("= \n"),
                 "tests_passed": int(passed.group(1)) if passed else None,
                 "clean": int(rc) == 0 and errors == 0})
    os.remove(path)
json.dump({"sanitizers": rows}, open(os.path.join(out, "sanitize.json"), "w"), indent=1)
for r in rows:
    print(f"compute-sanitizer {r['tool']:<9} {r['family']:<16} exit {r['exit_code']:>3} "
          f"in {r['seconds']:>4}s: {r['summary'] or 'no summary (timed out or crashed)'}; "
          f"tests passed: {r['tests_passed']}")
sys.exit(0 if rows and all(r["clean"] for r in rows) else 1)
PYEOF
exit $status
