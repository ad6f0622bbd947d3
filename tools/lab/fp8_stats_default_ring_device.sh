#!/usr/bin/env bash
# Session 37: the bulk statistics kernel's new default ring (rows of 4+ rounds: 1-round chunks in
# 3 slots) on prebuilt binaries (carry [".devbin"]): the Fp8Norm suite, `fusekit check
# fp8_rms_norm`, memcheck on the bitwise test, then forward/backward with the old default forced
# (FUSEKIT_FP8_STATS_ROUNDS=2 FUSEKIT_FP8_STATS_STAGES=2) and the new one, alternating.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
B=.devbin/build
(cd $B && xz -dkf fusekit.xz && xz -dkf fusekit_tests.xz && chmod +x fusekit fusekit_tests)
S=$OUT/summary.txt
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(date -u +%FT%TZ)" | tee $S
timeout 300 $B/fusekit_tests --gtest_filter='Fp8Norm*' > $OUT/tests.log 2>&1
echo "== tests Fp8Norm* rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' $OUT/tests.log | tr '\n' ' ')" | tee -a $S
grep -E "Failure|exception" -A4 $OUT/tests.log | head -20 | tee -a $S
$B/fusekit check fp8_rms_norm > $OUT/check.log 2>&1
echo "== fusekit check fp8_rms_norm rc=$?: $(tail -1 $OUT/check.log)" | tee -a $S
compute-sanitizer --tool memcheck --error-exitcode 9 $B/fusekit_tests \
  --gtest_filter='Fp8NormGpu.BulkStatisticsMatchRegisterKernelBitwise' > $OUT/memcheck.log 2>&1
echo "== memcheck rc=$?: $(grep -E 'ERROR SUMMARY' $OUT/memcheck.log | tail -1)" | tee -a $S
for i in 1 2 3; do
  for cfg in old new; do
    if [ $cfg = old ]; then env="FUSEKIT_FP8_STATS_ROUNDS=2 FUSEKIT_FP8_STATS_STAGES=2"; else env=""; fi
    env $env timeout 90 $B/fusekit bench fp8_rms_norm > $OUT/b-$cfg-$i.log 2>&1
    echo "== $i $cfg rc=$?: $(grep -E 'fwd|bwd' $OUT/b-$cfg-$i.log | awk '{print $2, $3, $4, $6}' | tr '\n' ' ')" | tee -a $S
  done
done
grep ceilings $OUT/b-new-3.log | tee -a $S
