#!/usr/bin/env bash
# Session 37: with the warp-wide copier, do other ring shapes of the bulk statistics kernel pay
# now? Forward us for FUSEKIT_FP8_STATS_ROUNDS x FUSEKIT_FP8_STATS_STAGES and the register kernel,
# two alternating passes, on prebuilt binaries (carry [".devbin"]).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
B=.devbin/build
(cd $B && xz -dkf fusekit.xz && chmod +x fusekit)
for pass in 1 2; do
  for cfg in bulk,2,2 bulk,2,3 bulk,1,2 bulk,1,3 bulk,1,4 registers,2,2; do
    IFS=, read -r design rounds stages <<<"$cfg"
    FUSEKIT_FP8_STATS=$design FUSEKIT_FP8_STATS_ROUNDS=$rounds FUSEKIT_FP8_STATS_STAGES=$stages timeout 90 \
      $B/fusekit bench fp8_rms_norm > $OUT/b.log 2>&1
    echo "== pass $pass $design rounds $rounds stages $stages rc=$?: $(grep -E 'fwd' $OUT/b.log | awk '{print $3, $4, $6}' | tr '\n' ' ')" | tee -a $OUT/sweep.txt
  done
done
grep ceilings $OUT/b.log | tee -a $OUT/sweep.txt
