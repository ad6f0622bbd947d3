#!/usr/bin/env bash
# Why the dz-in-dgrad GEMM's tests end the process under racecheck: the tool's options, a plain
# run, and racecheck variants on the smallest forced shape.
set -u
b=${1:-build-device}; o=${2:-out}/diag; mkdir -p "$o"
t=$b/fusekit_tests
compute-sanitizer --help > "$o/help.txt" 2>&1
f='LinearGpu/DzInDgrad.MatchesReference/0'
$t --gtest_filter="$f" > "$o/plain.log" 2>&1; echo "plain rc=$?" >> "$o/rc.txt"
run() { local name=$1; shift
  timeout 200 compute-sanitizer "$@" $t --gtest_filter="$f" > "$o/$name.log" 2>&1
  echo "$name rc=$?" >> "$o/rc.txt"; }
run default --tool racecheck --print-level info --show-backtrace yes &
run nomemcpy --tool racecheck --racecheck-memcpy-async no &
run memcheck --tool memcheck &
wait
dmesg 2>/dev/null | tail -20 > "$o/dmesg.txt"
