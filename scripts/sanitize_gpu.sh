#!/usr/bin/env bash
# Runs every GPU test family under each compute-sanitizer tool (memcheck, racecheck, initcheck,
# synccheck):
#   scripts/sanitize_gpu.sh BUILD_DIR OUT_DIR
# It writes one log per job (OUT_DIR/sanitize/), a line per finished job
# (OUT_DIR/sanitize-results.tsv) and a JSON summary (OUT_DIR/sanitize.json).
# Each family's tests are split into GoogleTest shards, and the (family, tool, shard) jobs run
# concurrently on the one GPU (SANITIZE_JOBS at a time, default: the core count): most of a
# sanitized test's time is its float64 CPU reference and the host side of the instrumentation.
# Each job has its own time limit (SANITIZE_TIMEOUT seconds, default 540); a job that runs out
# counts as not clean.
# The tests whose only purpose is the benchmark shapes (hundreds of MB per tensor) are left out:
# every kernel they launch also runs at the smaller shapes of the same family's other tests.
# SANITIZE_FAMILIES and SANITIZE_TOOLS narrow the run (names as below); SANITIZE_CHECK_ONLY=1 only
# checks that every GPU test suite belongs to a family. On a 16-core machine two
# tools over every family take about 8 minutes: the device tool's 10-minute calls take two each.
set -uo pipefail
build=${1:?build directory}
out=${2:?output directory}
mkdir -p "$out"
tests="$build/fusekit_tests"
[ -x "$tests" ] || { echo "sanitize_gpu: $tests not built" >&2; exit 1; }

declare -A filters=(
  [norm]="NormGpu.*:NormTailGpu*:NormElementGpu*"
  [norm_residual]="NormResidualGpu.*"
  [bias_act_dropout]="BiasActDropoutGpu.*"
  [linear]="LinearGpu*:GatedLinearGpu*"
  [fp8_norm]="Fp8NormGpu.*"
  [attention]="AttentionGpu.*"
  [cross_entropy]="CrossEntropyGpu.*"
  [linear_cross_entropy]="LinearCrossEntropyGpu.*"
  [gated_act]="GatedActGpu.*"
  [rope]="RopeGpu.*"
  [embedding]="EmbeddingGpu.*"
  [optim]="OptimGpu.*"
  [core]="PhiloxGpu.*:ActivationGpu.*:LaunchTuningGpu.*"
)
# Shards per family, from the sanitized runs' test times (the linear and norm suites are longest).
declare -A shards=([norm]=4 [norm_residual]=2 [bias_act_dropout]=2 [linear]=4 [fp8_norm]=3 [attention]=3
                   [core]=1 [cross_entropy]=2 [linear_cross_entropy]=2 [gated_act]=3 [rope]=1 [embedding]=1
                   [optim]=1)
# Where one tool's shards run longest (the sanitized runs' times), more of them.
declare -A tool_shards=([linear:racecheck]=20 [linear:synccheck]=14 [linear_cross_entropy:racecheck]=4
                        [embedding:initcheck]=2)
large="*BenchmarkShapes*:*LargerShapes*:*LongCausalSequence*"
# Tests that provoke a CUDA API error on purpose (a launch that must fail without the shared-memory
# opt-in): memcheck reports every API error, so they run under the other tools only.
api_error_tests="LaunchTuningGpu.StaticPlusDefaultDynamicNeedsTheOptIn"
families=${SANITIZE_FAMILIES:-"norm norm_residual bias_act_dropout linear fp8_norm attention cross_entropy linear_cross_entropy gated_act rope embedding optim core"}
tools=${SANITIZE_TOOLS:-"memcheck racecheck initcheck synccheck"}

# Every GPU test suite (a name with Gpu in it, parameterized ones as Prefix/Suite) belongs to a
# family above: a new suite left out would pass unsanitized without anyone noticing.
patterns=$(IFS=':'; echo "${filters[*]}" | tr ':' ' ')
for suite in $("$tests" --gtest_list_tests | grep -oE '^[A-Za-z0-9_/]*Gpu[A-Za-z0-9_/]*\.' | sort -u); do
  found=0
  for pattern in $patterns; do [[ "${suite}test" == $pattern ]] && found=1; done
  (( found )) || { echo "sanitize_gpu: suite ${suite%.} is in no family's filter" >&2; exit 1; }
done
# SANITIZE_CHECK_ONLY=1: that check alone (ctest SanitizeGpu.everySuiteInAFamily, no GPU needed).
if [ -n "${SANITIZE_CHECK_ONLY:-}" ]; then
  echo "sanitize_gpu: every GPU test suite is in a family's filter"
  exit 0
fi

mkdir -p "$out/sanitize"
: >"$out/sanitize-results.tsv"
# On a machine of several GPUs the jobs take them in turns: job k sees GPU k mod n first (every
# GPU stays visible, for the tests that use two).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
(( gpus >= 1 )) || gpus=1
gpu_order() {
  local first=$(( $1 % gpus )) order=() i
  for (( i = 0; i < gpus; ++i )); do order+=($(( (first + i) % gpus ))); done
  local IFS=,
  echo "${order[*]}"
}
run_one() {
  local index=$1
  shift
  local family=$1 tool=$2 filter=$3 shard=$4 count=$5 log="$out/sanitize/$1-$2-$4.log"
  local exclude=$large
  [ "$tool" = memcheck ] && exclude="$exclude:$api_error_tests"
  local extra=() limit=20
  # synccheck tracks the TMA-ring mbarriers (cuda::barrier) only with a fixed per-block budget:
  # its automatic sizing overflows ("overflow of tracked cuda::barrier"). linear_cross_entropy has
  # no such kernel of its own, and under that budget synccheck failed to allocate its tracking for
  # the cuBLAS and cross-entropy launches ("Unable to allocate enough memory"): it keeps the default.
  # LinearGpu.BackwardRouting's GEMMs (4096 x 4096 x 2048: the routing depends on the size) outrun
  # any limit under synccheck and racecheck; the kernels it routes to run at the smaller shapes of
  # the LinearGpu/DzInDgrad and LinearGpu/BackwardGrid tests.
  if [ "$tool" = synccheck ]; then
    [ "$family" = linear_cross_entropy ] || extra=(--num-cuda-barriers 4096)
  fi
  [ "$tool" = synccheck ] || [ "$tool" = racecheck ] && exclude="$exclude:LinearGpu.BackwardRouting"
  # cuBLASLt's Hopper GEMMs (nvjet_*, NVIDIA's closed kernels behind the linear family) order
  # their shared memory through TMA and mbarriers, which racecheck does not follow: it reports
  # hazards in every one of them. Leaving them out (--kernel-name-exclude) makes racecheck fail
  # with "failed to handle a hardware exception", so they run checked, every hazard is printed,
  # and the summary below counts those in nvjet_* kernels apart from fusekit's.
  [ "$tool" = racecheck ] && limit=1000000
  # With cuBLASLt's timed algorithm choice, racecheck instruments every candidate GEMM it times:
  # LinearGpu.RunsAreBitwiseReproducible grew to 34 GB of host memory and its process ended
  # without a message, and passed with the choice off (5.4 GB). The choice only picks among
  # cuBLASLt's kernels, so under racecheck the linear family takes the heuristic's first one (the
  # two tests of the choice itself, AutotunedPathIsEligibleAndKept and FirstCallInsideGraphCapture,
  # turn it on for themselves).
  local overrides=()
  [ "$tool" = racecheck ] && [ "$family" = linear ] && overrides=(FUSEKIT_OVERRIDE=linear.autotune=off)
  local start=$(date +%s)
  env ${overrides[@]+"${overrides[@]}"} CUDA_VISIBLE_DEVICES=$(gpu_order "$index") GTEST_TOTAL_SHARDS=$count GTEST_SHARD_INDEX=$shard OMP_NUM_THREADS=2 \
    timeout "${SANITIZE_TIMEOUT:-540}" compute-sanitizer --tool "$tool" \
    --print-limit "$limit" ${extra[@]+"${extra[@]}"} --error-exitcode 9 \
    "$tests" --gtest_filter="$filter-$exclude" >"$log" 2>&1
  local rc=$? secs=$(( $(date +%s) - start ))
  local summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)
  local gtest=$(grep -E '^\[  (PASSED|FAILED) ' "$log" | tr '\n' ' ')
  # One line per finished job, appended at once: a run stopped early keeps what finished.
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$family" "$tool" "$rc" "$secs" "$summary" "$gtest" "$log" >>"$out/sanitize-results.tsv"
}
export -f run_one gpu_order
export out tests large api_error_tests gpus SANITIZE_TIMEOUT

jobs=()
for family in $families; do
  for tool in $tools; do
    count=${tool_shards[$family:$tool]:-${shards[$family]}}
    for shard in $(seq 0 $(( count - 1 ))); do
      jobs+=("${#jobs[@]} $family $tool ${filters[$family]} $shard $count")
    done
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P "${SANITIZE_JOBS:-$(nproc)}" -L 1 bash -c 'run_one "$0" "$1" "$2" "$3" "$4" "$5"'

status=0
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
python3 - "$out" "${device:-unknown}" "$gpus" <<'PYEOF' || status=1
import glob, json, os, re, sys
out = sys.argv[1]
# One row per (family, tool): its shards' errors and tests summed, the slowest shard's time.
rows = {}
for line in sorted(open(os.path.join(out, "sanitize-results.tsv")).read().splitlines()):
    family, tool, rc, secs, summary, gtest, log = (line.split("\t") + [""] * 7)[:7]
    # "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)".
    m = re.search(r"\((\d+) errors?\b", summary) or re.search(r"ERROR SUMMARY: (\d+) error", summary)
    errors = int(m.group(1)) if m else None
    passed = re.search(r"PASSED\s*\]\s+(\d+)", gtest)
    r = rows.setdefault((family, tool), {"family": family, "tool": tool, "shards": 0, "exit_codes": [],
                                         "seconds": 0, "errors": 0, "tests_passed": 0})
    if tool == "racecheck" and errors is not None and os.path.exists(log):
        # Each hazard is a "Race reported between ... access at <kernel>+0x.. / and ... access at
        # <kernel>+0x.." pair of lines; those in cuBLASLt's nvjet_* kernels are counted apart.
        text = open(log, errors="replace").read().splitlines()
        foreign = sum(1 for i, l in enumerate(text) if "Error: Race reported" in l
                      and "nvjet" in l + (text[i + 1] if i + 1 < len(text) else ""))
        r["cublaslt_hazards"] = r.get("cublaslt_hazards", 0) + foreign
        errors -= foreign
        if errors == 0 and rc == "9" and "Internal Sanitizer Error" not in "\n".join(text) \
                and "FAILED" not in gtest and passed:
            rc = "0"  # the exit status of hazards in cuBLASLt's kernels alone
    r["shards"] += 1
    r["exit_codes"].append(int(rc))
    r["seconds"] = max(r["seconds"], int(secs))
    r["errors"] = None if errors is None or r["errors"] is None else r["errors"] + errors
    r["tests_passed"] += int(passed.group(1)) if passed else 0
rows = [dict(r, clean=r["errors"] == 0 and not any(r["exit_codes"])) for r in rows.values()]
# scripts/perf_report.py --merge files it into the device's record.
json.dump({"kind": "sanitize", "device": sys.argv[2], "gpus": int(sys.argv[3]), "sanitizers": rows},
          open(os.path.join(out, "sanitize.json"), "w"), indent=1)
for r in rows:
    errors = "no summary in some shard (timed out or crashed)" if r["errors"] is None else f"{r['errors']} errors"
    print(f"compute-sanitizer {r['tool']:<9} {r['family']:<16} {'clean' if r['clean'] else 'NOT CLEAN'}: "
          f"{errors}, {r['tests_passed']} tests passed, exit codes {r['exit_codes']}, "
          + (f"{r['cublaslt_hazards']} hazards in cuBLASLt's nvjet kernels apart, " if "cublaslt_hazards" in r else "") +
          f"slowest of {r['shards']} shards {r['seconds']}s")
sys.exit(0 if rows and all(r["clean"] for r in rows) else 1)
PYEOF
exit $status
