#!/usr/bin/env bash
# On the GPU machine: train_gpt (fusekit, C++) against apps/train_gpt/reference.py (PyTorch,
# torch.compile) on the same model, initial weights and data order, dropout 0, STEPS steps each
# (default 50, GPT-2 124M shapes), and the reference once more in float32 (the yardstick of the
# loss bar). Leaves in $OUT: the runs' logs and per-step losses, and train_gpt_compare.json
# (per-step losses, their differences and errors against float32, median step times, the speed
# ratio); exits 1 when the losses fail train_gpt_compare.py's bar.
#   device tool: run(command="bash scripts/train_gpt_compare.sh", carry=[".deps"])
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
BUILD=${BUILD:-build-device}
STEPS=${STEPS:-50}
BATCH=${BATCH:-16}
PRESET=${PRESET:-gpt2-124m}
PYTHON=${PYTHON:-python3}
export PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$OUT"

if [ "${BUILD_FIRST:-1}" = 1 ]; then  # BUILD_FIRST=0: use the train_gpt already in $BUILD
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/train_gpt_build.log" 2>&1
  cmake --build "$BUILD" -j "$(nproc)" --target train_gpt >>"$OUT/train_gpt_build.log" 2>&1 ||
    { tail -40 "$OUT/train_gpt_build.log"; exit 1; }
fi

"$BUILD/apps/train_gpt/train_gpt" --device cuda --preset "$PRESET" --steps "$STEPS" --batch "$BATCH" \
  --dropout 0 --val-every "$STEPS" --save-init "$OUT/train_gpt_init.bin" \
  --losses-json "$OUT/train_gpt_losses.json" --sample-tokens 200 | tee "$OUT/train_gpt.log"
"$PYTHON" apps/train_gpt/reference.py --checkpoint "$OUT/train_gpt_init.bin" --steps "$STEPS" \
  --batch "$BATCH" --compile --losses-json "$OUT/reference_losses.json" | tee "$OUT/reference.log"
"$PYTHON" apps/train_gpt/reference.py --checkpoint "$OUT/train_gpt_init.bin" --steps "$STEPS" \
  --batch "$BATCH" --fp32 --losses-json "$OUT/reference_fp32_losses.json" | tee "$OUT/reference_fp32.log"
rm -f "$OUT/train_gpt_init.bin"  # 1.5 GB of weights and moments: not worth bringing back
status=0
"$PYTHON" scripts/train_gpt_compare.py "$OUT/train_gpt_losses.json" "$OUT/reference_losses.json" \
  "$OUT/reference_fp32_losses.json" >"$OUT/train_gpt_compare.json" || status=$?
cat "$OUT/train_gpt_compare.json"
exit "$status"
