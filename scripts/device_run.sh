#!/usr/bin/env bash
# The one script for the GPU machine: build with all cores, run the whole test suite, the CLI
# check, the benchmarks and the PyTorch side-by-side timings, and leave logs + JSON in $OUT.
#   device tool: run(command="bash scripts/device_run.sh", carry=[".deps", ".whl"])
# Stages can be narrowed: STAGES="build test bench torch sanitize" (default: all but norm_sweep, e2e,
# torch_dist (fusekit.torch.patch under DDP and FSDP2 against one GPU, scripts/torch_dist_check.py)
# and ddp (train_gpt --gpus N against one GPU, scripts/train_gpt_ddp_check.sh);
# sanitize: scripts/sanitize_gpu.sh, every GPU test family under each compute-sanitizer tool).
# python: the Python package built and its whole pytest suite run against CUDA PyTorch, plus the
# example training script; overhead: host time of fusekit.torch over the direct C++ call per op
# (python/benchmarks/overhead.py, 10 us budget; JSON in $OUT/overhead.json).
# BENCH_OPS / TORCH_OPS narrow the ops benchmarked (default: all).
# compare: a second source tree (BASELINE, default .baseline: e.g. `git archive <rev>` of an
# earlier commit, carried) is built too, and both builds' `fusekit bench` run in turns
# (COMPARE_ROUNDS each); scripts/bench_compare.py prints every fusekit row's new/base ratio.
# A build made elsewhere with the same CUDA (Release, sm_90a) can be carried instead of building
# here: BUILD=build STAGES="test sanitize" with carry ["build/fusekit_tests", "build/fusekit"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test check bench torch report python overhead sanitize"}
BUILD=${BUILD:-build-device}
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null) commit: $(git rev-parse --short HEAD 2>/dev/null || echo none) date: $(date -u +%FT%TZ)"

if has build; then
  [ -f .deps/.complete-v1 ] || { echo "missing .deps (carry it)"; exit 1; }
  start=$(date +%s)
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "$(nproc)" -- -v >>"$OUT/build.log" 2>&1
  rc=$?
  log "build rc=$rc in $(( $(date +%s) - start ))s"
  # Register/spill report for the kernels (ptxas -v) from the build log.
  grep -E "ptxas info|spill" "$OUT/build.log" | grep -B1 -A0 -E "bytes spill" | grep -E "[1-9][0-9]* bytes spill" | head -20 | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || { tail -50 "$OUT/build.log"; exit 1; }
fi

if has test; then
  # One run per op family (the first: every suite of no family), each with its own log and time
  # limit, so that a slow or hung family cannot hide the others' results. The runs share the GPU
  # concurrently (most of their time is the float64 CPU references), the cores split between them.
  suites=(${TEST_SUITES:-"-Norm*:BiasActDropout*:Linear*:GatedLinear*:Fp8Norm*:Attention*:CrossEntropy*:GatedAct*:Rope*:Embedding*:Optim*"
              "Norm*" "BiasActDropout*" "Linear*:GatedLinear*-LinearCrossEntropy*" "LinearCrossEntropy*" "Fp8Norm*" "Attention*"
              "CrossEntropy*" "GatedAct*" "Rope*" "Embedding*" "Optim*"})
  threads=$(( $(nproc) / ${#suites[@]} )); [ $threads -ge 1 ] || threads=1
  # On a machine of several GPUs the runs take them in turns as their first device; every GPU stays
  # visible (the tests of two GPUs).
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); (( gpus >= 1 )) || gpus=1
  start=$(date +%s)
  for i in "${!suites[@]}"; do
    order=$(for (( g = 0; g < gpus; ++g )); do echo $(( (i + g) % gpus )); done | paste -sd,)
    ( s=$(date +%s)
      CUDA_VISIBLE_DEVICES=$order OMP_NUM_THREADS=$threads timeout "${TEST_TIMEOUT:-400}" stdbuf -oL "$BUILD/fusekit_tests" \
        --gtest_filter="${suites[$i]}" >"$OUT/tests-$i.log" 2>&1
      echo "$? $(( $(date +%s) - s ))" >"$OUT/tests-$i.rc" ) &
  done
  wait
  : >"$OUT/tests.log"
  for i in "${!suites[@]}"; do
    read -r rc secs <"$OUT/tests-$i.rc"
    verdict=$(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-$i.log" | tr '\n' ' ')
    log "tests ${suites[$i]} rc=$rc in ${secs}s: $verdict"
    [ "$rc" -eq 0 ] || status=1
    cat "$OUT/tests-$i.log" >>"$OUT/tests.log"; rm -f "$OUT/tests-$i.log" "$OUT/tests-$i.rc"
  done
  log "tests: all suites in $(( $(date +%s) - start ))s"
  grep -E "^\[  FAILED  \]|Failure$" -A3 "$OUT/tests.log" | head -60
fi

if has sanitize; then
  start=$(date +%s)
  bash scripts/sanitize_gpu.sh "$BUILD" "$OUT" >"$OUT/sanitize.log" 2>&1
  rc=$?
  log "compute-sanitizer (every GPU test family x memcheck, racecheck, initcheck, synccheck) rc=$rc in $(( $(date +%s) - start ))s"
  tee -a "$OUT/summary.txt" <"$OUT/sanitize.log"
  [ $rc -eq 0 ] || status=1
fi

# train_gpt's data parallelism against one GPU (needs 2 or more GPUs; not in the default stages).
if has ddp; then
  start=$(date +%s)
  BUILD=$BUILD bash scripts/train_gpt_ddp_check.sh >"$OUT/ddp.log" 2>&1
  rc=$?
  log "train_gpt --gpus N check rc=$rc in $(( $(date +%s) - start ))s"
  tail -30 "$OUT/ddp.log"
  [ $rc -eq 0 ] || status=1
fi

if has package; then
  bash scripts/package_test.sh "$BUILD" >"$OUT/package.log" 2>&1
  rc=$?
  log "package test (find_package, add_subdirectory, pkg-config) rc=$rc: $(grep -c ': passed' "$OUT/package.log") passed"
  [ $rc -eq 0 ] || { tail -20 "$OUT/package.log"; status=1; }
  "$BUILD/fusekit_quickstart" >"$OUT/quickstart.log" 2>&1
  log "examples/quickstart.cpp rc=$?: $(tail -1 "$OUT/quickstart.log")"
fi

if has check; then
  "$BUILD/fusekit" check >"$OUT/check.log" 2>&1
  log "fusekit check rc=$?: $(tail -1 "$OUT/check.log")"
fi

if has bench; then
  "$BUILD/fusekit" bench ${BENCH_OPS:-} --json "$OUT/fusekit_bench.json" >"$OUT/bench.log" 2>&1
  log "fusekit bench rc=$?"
  cat "$OUT/bench.log"
fi

# The Python package (build-python/site, its own CMake build directory): for its tests, the host
# overhead, the norm sweep, and linear's and linear_cross_entropy's PyTorch comparisons
# (torch_bench.py times fusekit.torch in turns with PyTorch when it can import it).
torch_ops=" ${TORCH_OPS:-linear} "
if has python || has overhead || has norm_sweep || has e2e || has torch_dist ||
   { has torch && [[ "$torch_ops" == *" linear "* || "$torch_ops" == *" linear_cross_entropy "* ]]; }; then
  start=$(date +%s)
  FUSEKIT_PY_BUILD_ONLY=1 bash scripts/python_test.sh >"$OUT/python_build.log" 2>&1
  rc=$?
  log "python package build rc=$rc in $(( $(date +%s) - start ))s"
  [ $rc -eq 0 ] || { tail -30 "$OUT/python_build.log"; status=1; }
fi

if has torch; then
  # Peers that the machine lacks travel as wheels in .whl/ (Liger-Kernel: pure Python on Triton).
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/fusekit-peers .whl/*.whl >"$OUT/peers.log" 2>&1 &&
      export PYTHONPATH="/tmp/fusekit-peers${PYTHONPATH:+:$PYTHONPATH}"
    log "peer wheels (.whl): $(ls .whl | tr '\n' ' ')"
  fi
  PYTHONPATH="$PWD/build-python/site${PYTHONPATH:+:$PYTHONPATH}" \
  PYTHONUNBUFFERED=1 python3 scripts/torch_bench.py --out "$OUT/torch_bench.json" ${TORCH_OPS:-norm dropout linear gated_linear fp8_norm attention cross_entropy linear_cross_entropy gated_act rope} >"$OUT/torch.log" 2>&1
  log "torch bench rc=$?"
  tail -5 "$OUT/torch.log"
fi

# The norms over every row length (scripts/norm_sweep.py; not in the default stages: the whole
# sweep takes several calls, NORM_SWEEP_PART=K/P picks one interleaved part).
if has norm_sweep; then
  start=$(date +%s)
  PYTHONPATH="$PWD/build-python/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    python3 scripts/norm_sweep.py --out "$OUT/norm_sweep.json" --part "${NORM_SWEEP_PART:-1/1}" >"$OUT/norm_sweep.log" 2>&1
  rc=$?
  log "norm sweep part ${NORM_SWEEP_PART:-1/1} rc=$rc in $(( $(date +%s) - start ))s"
  tail -8 "$OUT/norm_sweep.log"
  [ $rc -eq 0 ] || status=1
fi

# Training steps of HuggingFace models (scripts/e2e_bench.py: eager, torch.compile, fusekit.torch.patch,
# both, Liger-Kernel; not in the default stages: E2E_MODELS picks the models).
if has e2e; then
  start=$(date +%s)
  PYTHONPATH="$PWD/build-python/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    python3 scripts/e2e_bench.py --out "$OUT/e2e.json" --models ${E2E_MODELS:-gpt2 llama-1.25b} >"$OUT/e2e.log" 2>&1
  rc=$?
  log "e2e bench rc=$rc in $(( $(date +%s) - start ))s"
  grep -vE "^\[transformers\]|^W[0-9]" "$OUT/e2e.log" | tail -14
  [ $rc -eq 0 ] || status=1
fi

# fusekit.torch.patch under DDP and FSDP2 (fully_shard), with and without torch.compile, on 2 and
# (where present) 4 GPUs against the 1-GPU run of the same global batch (needs 2 or more GPUs; not in
# the default stages; TORCH_DIST_MODELS picks the models). NCCL with NVLink multicast off.
if has torch_dist; then
  start=$(date +%s)
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  sizes=$(for w in 2 4; do [ "$w" -le "$gpus" ] && printf '%s ' "$w"; done)
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  PYTHONPATH="$PWD/build-python/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    python3 scripts/torch_dist_check.py --out "$OUT/torch_dist.json" --world-sizes ${sizes:-2} \
    --models ${TORCH_DIST_MODELS:-gpt2 llama-1.25b} >"$OUT/torch_dist.log" 2>&1
  rc=$?
  log "torch_dist check ($gpus GPUs, world sizes ${sizes:-none}) rc=$rc in $(( $(date +%s) - start ))s"
  grep -vE "^\[transformers\]|^(\[rank[0-9]+\]:)?W[0-9]" "$OUT/torch_dist.log" | tail -30
  [ $rc -eq 0 ] || status=1
fi

if has python; then
  start=$(date +%s)
  PYTHONPATH="$PWD/build-python/site" timeout "${PYTEST_TIMEOUT:-600}" python3 -X faulthandler -m pytest \
    tests/python -q -rf -p no:cacheprovider >"$OUT/python_tests.log" 2>&1
  rc=$?
  log "python tests rc=$rc in $(( $(date +%s) - start ))s: $(tail -1 "$OUT/python_tests.log")"
  [ $rc -eq 0 ] || { grep -E "^FAILED|Error" "$OUT/python_tests.log" | head -20; status=1; }
  PYTHONPATH="$PWD/build-python/site" timeout 300 python3 examples/train_block.py >"$OUT/train_block.log" 2>&1
  rc=$?
  log "examples/train_block.py rc=$rc: $(tail -1 "$OUT/train_block.log")"
  [ $rc -eq 0 ] || status=1
fi

if has overhead; then
  PYTHONPATH="$PWD/build-python/site" timeout 300 python3 python/benchmarks/overhead.py \
    --json "$OUT/overhead.json" >"$OUT/overhead.log" 2>&1
  rc=$?
  log "fusekit.torch host overhead rc=$rc (0: every op within the 10 us budget)"
  cat "$OUT/overhead.log"
  [ $rc -eq 0 ] || status=1
fi

if has compare; then
  base_src=${BASELINE:-.baseline}
  [ -e "$base_src/.deps" ] || ln -s "$PWD/.deps" "$base_src/.deps"
  start=$(date +%s)
  (cd "$base_src" && cmake -S . -B "$PWD/../build-baseline" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build-baseline.log" 2>&1 &&
    cmake --build "$PWD/../build-baseline" -j "$(nproc)" --target fusekit_cli >>"$OUT/build-baseline.log" 2>&1)
  rc=$?
  log "baseline build ($base_src) rc=$rc in $(( $(date +%s) - start ))s"
  if [ $rc -eq 0 ]; then
    base_runs=(); new_runs=()
    for round in $(seq "${COMPARE_ROUNDS:-3}"); do
      build-baseline/fusekit bench ${BENCH_OPS:-} --json "$OUT/compare-base-$round.json" >/dev/null 2>&1 && base_runs+=("$OUT/compare-base-$round.json")
      "$BUILD/fusekit" bench ${BENCH_OPS:-} --json "$OUT/compare-new-$round.json" >/dev/null 2>&1 && new_runs+=("$OUT/compare-new-$round.json")
    done
    python3 scripts/bench_compare.py --base "${base_runs[@]}" --new "${new_runs[@]}" --json "$OUT/compare.json" >"$OUT/compare.log" 2>&1
    log "bench compare rc=$? (0: no fusekit row more than 2% slower than the baseline): $(tail -1 "$OUT/compare.log")"
    grep SLOWER "$OUT/compare.log"
  else
    tail -20 "$OUT/build-baseline.log"; status=1
  fi
fi

if has report; then
  # The fresh runs as tables (a scratch copy of the records; merge into bench/results/ with
  # scripts/perf_report.py --merge in the repository).
  mkdir -p "$OUT/records"
  python3 scripts/perf_report.py --results "$OUT/records" --no-plots --out "$OUT/report.md" \
    --merge $(ls "$OUT/fusekit_bench.json" "$OUT/torch_bench.json" "$OUT/norm_sweep.json" "$OUT/e2e.json" \
      "$OUT/torch_dist.json" 2>/dev/null) >"$OUT/report.log" 2>&1
  cat "$OUT/report.md"
fi
exit $status
