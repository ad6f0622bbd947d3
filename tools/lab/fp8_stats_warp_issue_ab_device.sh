#!/usr/bin/env bash
# Session 37: forward/backward of main (.devbin/main/fusekit.xz) against this tree (.devbin/build/fusekit.xz),
# alternating, then the Python suite (carry [".devbin", ".deps"]).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
(cd .devbin/build && xz -dkf fusekit.xz && chmod +x fusekit) && (cd .devbin/main && xz -dkf fusekit.xz && chmod +x fusekit)
for i in 1 2 3; do
  for b in main build; do
    timeout 90 .devbin/$b/fusekit bench fp8_rms_norm > $OUT/ab-$b-$i.log 2>&1
    echo "== ab $i $b rc=$?: $(grep -E 'fwd|bwd' $OUT/ab-$b-$i.log | awk '{print $2, $3, $4, $6}' | tr '\n' ' ')" | tee -a $OUT/ab.txt
  done
done
grep ceilings $OUT/ab-build-3.log | tee -a $OUT/ab.txt
STAGES="python" bash scripts/device_run.sh 2>&1 | tail -15
