#!/usr/bin/env bash
# On a GPU machine with 2 or more GPUs: train_gpt's data parallelism (--gpus N) checked against one
# GPU, GPT-2 124M shapes at dropout 0, the same global batch (BATCH sequences) and seed:
#   1. 1 GPU, 2 GPUs and, where there are 4, 4 GPUs for STEPS steps: per-step losses compared with
#      the 1-GPU run (the replicas' parameters checked bitwise identical every 5 steps);
#   2. resume across GPU counts: 2 GPUs stop after step STEPS / 2 and save; 1 GPU (and 4, where
#      there are 4) resume from that checkpoint; their losses compared with the uninterrupted
#      2-GPU run's;
#   3. scaling: N GPUs at N x BATCH sequences (BATCH per GPU) for 12 steps: tokens/s per GPU against
#      the 1-GPU run's.
# Leaves in $OUT: train_gpt_ddp_build.log, train_gpt_ddp.log (every run's output) and
# train_gpt_ddp_check.json (the loss differences, tokens/s in all and per GPU, pass or fail against
# TOLERANCE before the first loss spike, relative AFTER_SPIKE from it on: scripts/train_gpt_ddp_check.py);
# exits 1 when a loss difference exceeds its bound.
#   device tool: run(command="bash scripts/train_gpt_ddp_check.sh", kind="nvidia-h100-x2", carry=[".deps"])
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
BUILD=${BUILD:-build-device}
STEPS=${STEPS:-20}
BATCH=${BATCH:-16}
PRESET=${PRESET:-gpt2-124m}
TOLERANCE=${TOLERANCE:-2e-3}
AFTER_SPIKE=${AFTER_SPIKE:-0.02}
PYTHON=${PYTHON:-python3}
export PATH=/usr/local/cuda/bin:$PATH
# NVLink multicast stays off: on a shared host it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
if (( gpus < 2 )); then echo "train_gpt_ddp_check: needs 2 or more GPUs, found $gpus"; exit 1; fi

if [ "${BUILD_FIRST:-1}" = 1 ]; then  # BUILD_FIRST=0: use the train_gpt already in $BUILD
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/train_gpt_ddp_build.log" 2>&1
  grep 'train_gpt: NCCL' "$OUT/train_gpt_ddp_build.log" || true
  cmake --build "$BUILD" -j "$(nproc)" --target train_gpt >>"$OUT/train_gpt_ddp_build.log" 2>&1 ||
    { tail -40 "$OUT/train_gpt_ddp_build.log"; exit 1; }
fi

log="$OUT/train_gpt_ddp.log"
: >"$log"
runs=()
# train NAME ARGS...: one run, its output appended to the log, its losses in $work/NAME.json.
train() {
  local name=$1
  shift
  echo "==== $name: train_gpt $*" | tee -a "$log"
  "$BUILD/apps/train_gpt/train_gpt" --device cuda --preset "$PRESET" --dropout 0 \
    --val-batches 2 --sample-tokens 0 --losses-json "$work/$name.json" "$@" 2>&1 | tee -a "$log"
  runs+=("$name=$work/$name.json")
}
common=(--steps "$STEPS" --batch "$BATCH" --val-every "$STEPS")

train gpus1 "${common[@]}" --gpus 1
train gpus2 "${common[@]}" --gpus 2 --check-replicas 5
if (( gpus >= 4 )); then train gpus4 "${common[@]}" --gpus 4 --check-replicas 5; fi

half=$((STEPS / 2))
train resume_from_gpus2 "${common[@]}" --gpus 2 --stop-after "$half" --save "$work/ckpt.bin"
train resumed_on_gpus1 "${common[@]}" --gpus 1 --resume "$work/ckpt.bin"
if (( gpus >= 4 )); then train resumed_on_gpus4 "${common[@]}" --gpus 4 --resume "$work/ckpt.bin"; fi

for n in 2 4; do
  if (( gpus >= n )); then
    train "scaling_gpus$n" --steps 12 --batch $((n * BATCH)) --val-every 12 --gpus "$n"
  fi
done

"$PYTHON" scripts/train_gpt_ddp_check.py --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" --tolerance "$TOLERANCE" --after-spike "$AFTER_SPIKE" "${runs[@]}" >"$OUT/train_gpt_ddp_check.json" ||
  status=$?
cat "$OUT/train_gpt_ddp_check.json"
exit "${status:-0}"
