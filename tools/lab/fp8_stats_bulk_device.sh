#!/usr/bin/env bash
# Lab branch lab/fp8-stats-bulk (on top of lab/fp8-fused-forward): one device call that checks
# and times the bulk-copy statistics kernel of the two-pass FP8 forward, then the fused forward's
# untested follow-ups. Pack prebuilt binaries first (docs/performance-notes.md, FP8 RMSNorm):
#   rm -rf .devbin .devpack && mkdir -p .devbin/cur .devpack && cp build/fusekit build/fusekit_tests .devbin/cur/ &&
#   tar -C .devbin -cf - . | xz -T2 -3 > .devpack/bins.tar.xz && cp tools/lab/fp8_stats_bulk_device.sh .devpack/
# then run `bash .devpack/fp8_stats_bulk_device.sh` with carry [".devpack"] (about 8 minutes).
# Everything goes to $OUT/summary.txt as it happens, most important first.
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
suite stats 'Fp8NormGpu.BulkStatisticsMatchRegisterKernelBitwise:Fp8NormGpu.StatsDesignRouting' 150
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = synccheck ] && extra=(--num-cuda-barriers 4096)
  timeout 120 compute-sanitizer --tool $tool ${extra[@]+"${extra[@]}"} --print-limit 4 $B/fusekit_tests \
    --gtest_filter='Fp8NormGpu.StatsDesignRouting' > $L/s-$tool.log 2>&1
  echo "== $tool rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $L/s-$tool.log | tr '\n' ' ')" | tee -a $S
  grep -m6 -E "Illegal|Invalid|hazard|at .*0x" $L/s-$tool.log | tee -a $S
done
run() { env "$@" timeout 60 $B/fusekit bench fp8_rms_norm > $L/b.log 2>&1; echo "== $* rc=$?" | tee -a $S; grep -E "fwd|copy" $L/b.log | tee -a $S; }
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
# The statistics kernel alone (Nsight Compute, real clocks, one warm call at (16384, 4096)).
for d in registers bulk; do
  FUSEKIT_FP8_FORWARD=two_pass FUSEKIT_FP8_STATS=$d FUSEKIT_BENCH_SHAPES=16384x4096 timeout 120 \
    ncu --clock-control none --kernel-name regex:stats --launch-skip 20 --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
    $B/fusekit bench fp8_rms_norm > $L/ncu-$d.log 2>&1
  echo "== ncu stats $d rc=$?" | tee -a $S
  grep -E "stats_|duration|dram__|inst_executed|warps_active" $L/ncu-$d.log | head -8 | tee -a $S
done
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
