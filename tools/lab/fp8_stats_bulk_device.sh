#!/usr/bin/env bash
# Lab branch lab/fp8-stats-bulk (on top of lab/fp8-fused-forward): one device call that checks
# and times the bulk-copy statistics kernel of the two-pass FP8 forward, then the fused forward's
# untested follow-ups. Pack prebuilt binaries first (docs/performance-notes.md, FP8 RMSNorm):
#   rm -rf .devbin .devpack && mkdir -p .devbin/cur .devpack && cp build/fusekit build/fusekit_tests .devbin/cur/ &&
#   tar -C .devbin -cf - . | xz -T2 -3 > .devpack/bins.tar.xz && cp tools/lab/fp8_stats_bulk_device.sh .devpack/
# then run `bash .devpack/fp8_stats_bulk_device.sh` with carry [".devpack"]. PART=1 (the bulk
# statistics kernel: tests, sanitizers, timings, profiles; ~6 minutes), PART=2 (the Fp8, Norm
# and Linear suites, the fused forward's sweep; ~5 minutes) and PART=3 (branch
# lab/fp8-bwd-deferred-sum: the backward's deferred row sums, tests, sanitizers, timings against
# the barrier, profiles; ~4 minutes) fit one device call each; unset runs all three. Everything
# goes to $OUT/summary.txt as it happens, most important first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p .devbin && tar -C .devbin -xJf .devpack/bins.tar.xz
B=.devbin/cur; L=$OUT/logs; mkdir -p $L; S=$OUT/summary.txt
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(date -u +%FT%TZ)" | tee $S
suite() {  # name filter timeout
  local start=$(date +%s)
  timeout "$3" $B/fusekit_tests --gtest_filter="$2" > $L/t-$1.log 2>&1
  echo "== tests $2 rc=$? in $(( $(date +%s) - start ))s: $(grep -E '^\[  (PASSED|FAILED) ' $L/t-$1.log | tr '\n' ' ')" | tee -a $S
  grep -E "FAILED|Failure|exception|qy:|rstd:|\[fp8_norm\]" $L/t-$1.log | head -30 | tee -a $S
}
sanitize() {  # tag filter timeout: memcheck, racecheck and synccheck on one test
  for tool in memcheck racecheck synccheck; do
    local extra=(); [ $tool = synccheck ] && extra=(--num-cuda-barriers 4096)
    timeout "$3" compute-sanitizer --tool $tool ${extra[@]+"${extra[@]}"} --print-limit 4 $B/fusekit_tests \
      --gtest_filter="$2" > $L/s-$1-$tool.log 2>&1
    echo "== $tool ($1) rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $L/s-$1-$tool.log | tr '\n' ' ')" | tee -a $S
    grep -m6 -E "Illegal|Invalid|hazard|at .*0x" $L/s-$1-$tool.log | tee -a $S
  done
}
bench() {  # line-regex env...: one `fusekit bench fp8_rms_norm` under the given environment
  local pick=$1; shift
  env "$@" timeout 60 $B/fusekit bench fp8_rms_norm > $L/b.log 2>&1
  echo "== $* rc=$?" | tee -a $S; grep -E "$pick|copy" $L/b.log | tee -a $S
}
run() { bench fwd "$@"; }
runb() { bench bwd "$@"; }
profile() {  # tag kernel-regex shape env...: Nsight Compute on one warm call (real clocks)
  local tag=$1 kernel=$2 shape=$3; shift 3
  env "$@" FUSEKIT_BENCH_SHAPES=$shape timeout 150 \
    ncu --clock-control none --kernel-name regex:$kernel --launch-skip 20 --launch-count 1 \
    --section SchedulerStats --section WarpStateStats \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
    $B/fusekit bench fp8_rms_norm > $L/ncu-$tag.log 2>&1
  echo "== ncu $tag ($kernel at $shape, $*) rc=$?" | tee -a $S
  grep -E "gpu__time|dram__|inst_executed|warps_active|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|stalled|Stall" \
    $L/ncu-$tag.log | head -14 | tee -a $S
}
PART=${PART:-all}
if [ "$PART" = 3 ] || [ "$PART" = all ]; then
# The backward's row sums, deferred (mbarriers, one first pass late) against the barrier: bitwise
# equal outputs, the routing, the sanitizers (racecheck sees the slots, synccheck the barriers),
# then alternating timings and where the (8192, 8192) kernel's warps stall under each.
suite rowsum 'Fp8NormGpu.DeferredRowSumBackwardMatchesBarrierBitwise:Fp8NormGpu.BackwardRowSumRouting' 150
sanitize rowsum 'Fp8NormGpu.BackwardRowSumRouting' 150
for i in 1 2; do
  runb FUSEKIT_FP8_BWD_ROWSUM=barrier
  runb FUSEKIT_FP8_BWD_ROWSUM=deferred
done
for r in barrier deferred; do profile bwd-$r backward_vector 8192x8192 FUSEKIT_FP8_BWD_ROWSUM=$r; done
[ "$PART" = 3 ] && exit 0
fi
if [ "$PART" != 2 ]; then
suite stats 'Fp8NormGpu.BulkStatisticsMatchRegisterKernelBitwise:Fp8NormGpu.StatsDesignRouting' 150
sanitize stats 'Fp8NormGpu.StatsDesignRouting' 120
# The statistics kernels against each other (two-pass forward), alternating.
for i in 1 2; do
  run FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=registers
  run FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=bulk
done
# Ring shapes: chunks of one round with 2 to 6 slots. The smaller rings leave room on the SM for
# a quantize block (64 KB) while the statistics drain, so its early copies overlap them.
for st in 2 3 4 6; do
  run FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=bulk FUSEKIT_FP8_STATS_ROUNDS=1 FUSEKIT_FP8_STATS_STAGES=$st
done
# The statistics kernel alone, then the quantize kernel behind each (Nsight Compute, real clocks,
# one warm call at (16384, 4096)): time, DRAM, instructions, and where the warps stall.
for d in registers bulk; do profile stats-$d stats 16384x4096 FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=$d; done
profile quantize-registers quantize 16384x4096 FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=registers
fi
[ "$PART" = 1 ] && exit 0
# The fused forward's untested follow-ups (session 33), then the whole Fp8 suite (the fused
# forward's tests included), the norm suite (its bulk-copy helpers moved to core/device_vector.cuh)
# and the linear suite (its path overrides now core/choice_override.h). The suites come last: the
# full device suite after a merge covers them too, so a call cut short loses the least there.
for i in 1 2; do run FUSEKIT_FP8_FORWARD=fused; done
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_LAB_PHASES=1
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_RING_FIRST=0
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_STASH=0
suite fp8 'Fp8*' 200
suite norm 'Norm*' 150
suite linear 'Linear*' 150
