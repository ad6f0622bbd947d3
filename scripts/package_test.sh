#!/usr/bin/env bash
# The C++ ways to consume fusekit, checked on any machine (one CPU op each, tests/consumer/):
#   1. `cmake --install` of the build, then a project that calls find_package(fusekit);
#   2. pkg-config's flags for the installed library, with a plain compiler call;
#   3. the same project pulling the source tree in with add_subdirectory;
#   4. the build without CUDA kernels (-DFUSEKIT_CUDA_KERNELS=OFF, what `make run` builds on a
#      machine without a GPU): the GPT trainer links and trains a few steps on the CPU backend.
# Usage: scripts/package_test.sh [build dir, default build]   (make test runs it after the suites)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=$root/${1:-build}
prefix=$build/install
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
jobs=$(nproc)

cmake --install "$build" --prefix "$prefix" >"$build/package-install.log"
echo "package_test: installed into $prefix"

cmake -S tests/consumer -B "$build/consumer-find" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CUDA_COMPILER="$nvcc" >"$build/consumer-find.log"
cmake --build "$build/consumer-find" -j "$jobs" >>"$build/consumer-find.log" ||
  { tail -30 "$build/consumer-find.log"; exit 1; }
"$build/consumer-find/consumer"
echo "package_test: find_package(fusekit): passed"

if command -v pkg-config >/dev/null; then
  export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
  c++ -std=c++17 tests/consumer/main.cpp $(pkg-config --cflags --libs fusekit) -o "$build/consumer-pkgconfig"
  LD_LIBRARY_PATH="$prefix/lib" "$build/consumer-pkgconfig"
  echo "package_test: pkg-config fusekit: passed"
else
  echo "package_test: pkg-config fusekit: skipped (no pkg-config on this machine)"
fi

cmake -S tests/consumer -B "$build/consumer-subdir" -G Ninja -DFUSEKIT_SOURCE_DIR="$root" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_BUILD_TYPE=Release >"$build/consumer-subdir.log" ||
  { tail -30 "$build/consumer-subdir.log"; exit 1; }
cmake --build "$build/consumer-subdir" -j "$jobs" >>"$build/consumer-subdir.log" ||
  { tail -30 "$build/consumer-subdir.log"; exit 1; }
"$build/consumer-subdir/consumer"
echo "package_test: add_subdirectory(fusekit): passed"

cmake -S . -B "$build/no-kernels" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFUSEKIT_CUDA_KERNELS=OFF \
  -DCMAKE_CUDA_COMPILER="$nvcc" >"$build/no-kernels.log"
cmake --build "$build/no-kernels" -j "$jobs" --target train_gpt >>"$build/no-kernels.log" ||
  { tail -30 "$build/no-kernels.log"; exit 1; }
"$build/no-kernels/apps/train_gpt/train_gpt" --device cpu --steps 3 >>"$build/no-kernels.log" ||
  { tail -30 "$build/no-kernels.log"; exit 1; }
grep -aE "^step +3/3" "$build/no-kernels.log"
echo "package_test: build without CUDA kernels, train_gpt on the CPU backend: passed"

