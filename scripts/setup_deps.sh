#!/usr/bin/env bash
# Installs fusekit's third-party dependencies into .deps/ (ignored by git), never into the system:
#   - Debian packages (header-only or source): CLI11, fmt, nlohmann-json, GoogleTest sources,
#     unpacked with dpkg -x into .deps/sysroot so the device machine can receive them via `carry`;
#   - the pinned PyPI wheel nvidia-cutlass for the CUTLASS/CuTe headers, into .deps/cutlass.
# Host tools (cmake, ninja, a C++ compiler, nvcc) must exist; missing Debian tools are installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/.deps"
stamp="$deps/.complete-v1"
[ -f "$stamp" ] && exit 0

DEBIAN_PACKAGES="libcli11-dev nlohmann-json3-dev libfmt-dev googletest"
CUTLASS_WHEEL="nvidia-cutlass==4.2.0.0"

need_tools=()
command -v cmake >/dev/null || need_tools+=(cmake)
command -v ninja >/dev/null || need_tools+=(ninja-build)
command -v g++   >/dev/null || need_tools+=(g++)
command -v unzip >/dev/null || true
if [ ${#need_tools[@]} -gt 0 ]; then
  echo "setup: installing missing tools: ${need_tools[*]}"
  apt-get update -qq && apt-get install -y -qq "${need_tools[@]}"
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: nvcc not found (expected /usr/local/cuda/bin/nvcc); the CUDA toolkit is required to build" >&2
  exit 1
fi

rm -rf "$deps"
mkdir -p "$deps/debs" "$deps/sysroot" "$deps/wheels" "$deps/cutlass"
(
  cd "$deps/debs"
  if ! apt-get download $DEBIAN_PACKAGES >/dev/null 2>&1; then
    apt-get update -qq
    apt-get download $DEBIAN_PACKAGES
  fi
  for f in *.deb; do dpkg -x "$f" "$deps/sysroot"; done
)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$deps/wheels" "$CUTLASS_WHEEL"
python3 - "$deps" <<'PY'
import sys, zipfile, glob, os
deps = sys.argv[1]
whl = glob.glob(os.path.join(deps, "wheels", "nvidia_cutlass-*.whl"))[0]
prefixes = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        for p in prefixes:
            if name.startswith(p) and not name.endswith("/"):
                dest = os.path.join(deps, "cutlass", "include" if "tools/util" not in p else "util_include", name[len(p):])
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with z.open(name) as src, open(dest, "wb") as dst:
                    dst.write(src.read())
PY
rm -rf "$deps/debs" "$deps/wheels"
touch "$stamp"
echo "setup: dependencies installed under .deps/"
