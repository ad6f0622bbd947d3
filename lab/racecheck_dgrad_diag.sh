#!/usr/bin/env bash
# Why two linear tests end the process under racecheck: each alone, with the tool's info output,
# its peak memory, and once with cuBLASLt's timed algorithm choice off.
set -u
b=${1:-build-device}; o=${2:-out}/diag; mkdir -p "$o"
t=$b/fusekit_tests
timer=(); [ -x /usr/bin/time ] && timer=(/usr/bin/time -v)
run() { local name=$1 filter=$2; shift 2
  ${timer[@]+"${timer[@]}"} timeout 280 compute-sanitizer --tool racecheck --print-level info "$@" $t --gtest_filter="$filter" > "$o/$name.log" 2>&1
  echo "$name rc=$? $(grep -E 'Maximum resident|Exit status|signal' "$o/$name.log" | tr '\n' ' ')" >> "$o/rc.txt"; }
run reproducible LinearGpu.RunsAreBitwiseReproducible &
run graph LinearGpu.FirstCallInsideGraphCapture &
FUSEKIT_OVERRIDE=linear.autotune=off run reproducible_untuned LinearGpu.RunsAreBitwiseReproducible &
wait
