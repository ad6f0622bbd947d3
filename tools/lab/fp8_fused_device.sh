#!/usr/bin/env bash
# Lab branch lab/fp8-fused-forward: one device call that checks and times the fused FP8 forward.
# Pack prebuilt binaries first (see docs/performance-notes.md, FP8 RMSNorm session 33):
#   mkdir -p .devbin/cur .devpack && cp build/fusekit build/fusekit_tests .devbin/cur/ &&
#   tar -C .devbin -cf - . | xz -T2 -3 > .devpack/bins.tar.xz && cp tools/lab/fp8_fused_device.sh .devpack/
# then run `bash .devpack/fp8_fused_device.sh` with carry [".devpack"].
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p .devbin && tar -C .devbin -xJf .devpack/bins.tar.xz
B=.devbin/cur; L=/tmp/logs; mkdir -p $L; S=$OUT/summary.txt
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(date -u +%FT%TZ)" | tee $S
start=$(date +%s); timeout 300 $B/fusekit_tests --gtest_filter='Fp8*' > $L/t.log 2>&1
echo "== tests Fp8* rc=$? in $(( $(date +%s) - start ))s: $(grep -E '^\[  (PASSED|FAILED) ' $L/t.log | tr '\n' ' ')" | tee -a $S
grep -E "FAILED|Failure|exception|qy:|rstd:|random seed|fused" $L/t.log | head -30 | tee -a $S
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --print-limit 4 $B/fusekit_tests --gtest_filter='Fp8NormGpu.ForwardDesignRouting' > $L/s.log 2>&1
  echo "== $tool rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $L/s.log | tr '\n' ' ')" | tee -a $S
  grep -m6 -E "Illegal|Invalid|hazard|at .*0x" $L/s.log | tee -a $S
done
run() { env "$@" timeout 90 $B/fusekit bench fp8_rms_norm > $L/b.log 2>&1; echo "== $* rc=$?" | tee -a $S; grep -E "fwd|copy" $L/b.log | tee -a $S; }
for i in 1 2; do run FUSEKIT_FP8_FORWARD=fused; run FUSEKIT_FP8_FORWARD=two_pass; done
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_LAB_PHASES=1
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_RING_FIRST=0
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_KEEP_PCT=0
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_KEEP_PCT=80
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_RING_KB=110
run FUSEKIT_FP8_FORWARD=fused FUSEKIT_FP8_FUSED_STASH=0
