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
PART=${PART:-all}
run() { env "$@" timeout 60 $B/fusekit bench fp8_rms_norm > $L/b.log 2>&1; echo "== $* rc=$?" | tee -a $S; grep -E "fwd|copy" $L/b.log | tee -a $S; }
if [ "$PART" = 3 ] || [ "$PART" = all ]; then
# The backward's row sums, deferred (mbarriers, one first pass late) against the barrier: bitwise
# equal outputs, the routing, the sanitizers (racecheck sees the slots, synccheck the barriers),
# then alternating timings and where the (8192, 8192) kernel's warps stall under each.
suite rowsum 'Fp8NormGpu.DeferredRowSumBackwardMatchesBarrierBitwise:Fp8NormGpu.BackwardRowSumRouting' 150
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = synccheck ] && extra=(--num-cuda-barriers 4096)
  timeout 150 compute-sanitizer --tool $tool ${extra[@]+"${extra[@]}"} --print-limit 4 $B/fusekit_tests \
    --gtest_filter='Fp8NormGpu.BackwardRowSumRouting' > $L/s3-$tool.log 2>&1
  echo "== $tool (row sums) rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $L/s3-$tool.log | tr '\n' ' ')" | tee -a $S
  grep -m6 -E "Illegal|Invalid|hazard|at .*0x" $L/s3-$tool.log | tee -a $S
done
runb() { env "$@" timeout 60 $B/fusekit bench fp8_rms_norm > $L/bb.log 2>&1; echo "== $* rc=$?" | tee -a $S; grep -E "bwd|copy" $L/bb.log | tee -a $S; }
for i in 1 2; do
  runb FUSEKIT_FP8_BWD_ROWSUM=barrier
  runb FUSEKIT_FP8_BWD_ROWSUM=deferred
done
profb() {  # row-sum scheme
  FUSEKIT_FP8_BWD_ROWSUM=$1 FUSEKIT_BENCH_SHAPES=8192x8192 timeout 150 \
    ncu --clock-control none --kernel-name regex:backward_vector --launch-skip 20 --launch-count 1 \
    --section SchedulerStats --section WarpStateStats \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum \
    $B/fusekit bench fp8_rms_norm > $L/ncu-bwd-$1.log 2>&1
  echo "== ncu backward 8192x8192 rowsum=$1 rc=$?" | tee -a $S
  grep -E "gpu__time|dram__|inst_executed|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|stalled|Stall" \
    $L/ncu-bwd-$1.log | head -14 | tee -a $S
}
for r in barrier deferred; do profb $r; done
[ "$PART" = 3 ] && exit 0
fi
if [ "$PART" != 2 ]; then
suite stats 'Fp8NormGpu.BulkStatisticsMatchRegisterKernelBitwise:Fp8NormGpu.StatsDesignRouting' 150
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = synccheck ] && extra=(--num-cuda-barriers 4096)
  timeout 120 compute-sanitizer --tool $tool ${extra[@]+"${extra[@]}"} --print-limit 4 $B/fusekit_tests \
    --gtest_filter='Fp8NormGpu.StatsDesignRouting' > $L/s-$tool.log 2>&1
  echo "== $tool rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $L/s-$tool.log | tr '\n' ' ')" | tee -a $S
  grep -m6 -E "Illegal|Invalid|hazard|at .*0x" $L/s-$tool.log | tee -a $S
done
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
prof() {  # design kernel-regex
  FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=$1 FUSEKIT_BENCH_SHAPES=16384x4096 timeout 150 \
    ncu --clock-control none --kernel-name regex:$2 --launch-skip 20 --launch-count 1 \
    --section SchedulerStats --section WarpStateStats \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
    $B/fusekit bench fp8_rms_norm > $L/ncu-$1-$2.log 2>&1
  echo "== ncu $2 after stats=$1 rc=$?" | tee -a $S
  grep -E "gpu__time|dram__|inst_executed|warps_active|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|stalled|Stall" \
    $L/ncu-$1-$2.log | head -14 | tee -a $S
}
for d in registers bulk; do prof $d stats; done
prof registers quantize
fi
[ "$PART" = 1 ] && exit 0
# The whole Fp8 suite (the fused forward's tests included), the norm suite (its bulk-copy
# helpers moved to core/device_vector.cuh) and the linear suite (its path overrides now
# core/choice_override.h).
suite fp8 'Fp8*' 200
suite norm 'Norm*' 150
suite linear 'Linear*' 150
# The fused forward's untested follow-ups (session 33).
for i in 1 2; do run FUSEKIT_FP8_FORWARD=fused; done
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_LAB_PHASES=1
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_RING_FIRST=0
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_STASH=0
