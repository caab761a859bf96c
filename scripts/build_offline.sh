#!/usr/bin/env bash
# Build our wheels with the current Python's own build tools (no build isolation, so no package
# index is needed) and install them into that Python, without their dependencies.
#   scripts/build_offline.sh [PACKAGE ...]     (default: all five)
# For a machine that cannot reach a package index, such as a GPU node whose Python already has
# torch: it needs scikit-build-core, pybind11, cmake and ninja (the native packages), hatchling
# (deepinfer, deepinfer-graph-timer), and the runtime's dependencies installed beforehand
# (docs/guide/01-install.md, "Without a package index"). CXX defaults to the system g++: a
# compiler that links libstdc++ statically makes our modules crash once torch is imported.
# Wheels go to ${WHEEL_DIR:-dist-offline}.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${WHEEL_DIR:-$root/dist-offline}
py=${PYTHON:-python3}
export CC=${CC:-gcc} CXX=${CXX:-g++}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [ $# -eq 0 ]; then
  set -- deepinfer-engine deepinfer-cuda deepinfer-ascend deepinfer-graph-timer deepinfer
fi
mkdir -p "$out"
wheels=()
for pkg in "$@"; do
  case $pkg in
    deepinfer) src=$root/deepinfer-meta ;;
    deepinfer-engine|deepinfer-cuda|deepinfer-ascend|deepinfer-graph-timer) src=$root/packages/$pkg ;;
    *) echo "build_offline.sh: unknown package '$pkg' (deepinfer-engine, deepinfer-cuda, deepinfer-ascend," \
            "deepinfer-graph-timer or deepinfer)" >&2; exit 2 ;;
  esac
  log=$out/build-$pkg.log
  echo "building $pkg (log: $log)"
  if ! "$py" -m pip wheel --no-build-isolation --no-deps --no-index -w "$out" "$src" >"$log" 2>&1; then
    tail -30 "$log" >&2
    echo "build_offline.sh: building $pkg failed; is its build backend installed in $py" \
         "(scikit-build-core + pybind11, or hatchling)?" >&2
    exit 1
  fi
  name=${pkg//-/_}
  wheels+=("$(ls -t "$out"/"$name"-*.whl | head -1)")
done
"$py" -m pip install --no-deps --no-index --force-reinstall "${wheels[@]}"
echo "installed: ${wheels[*]##*/}"
