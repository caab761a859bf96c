#!/usr/bin/env bash
# Incremental developer build of one native package, without pip.
#   scripts/devbuild.sh deepinfer-engine [BUILD_DIR] [extra cmake args...]
# Builds into BUILD_DIR (default build/dev/<package>) and lays out an importable copy of
# the package in BUILD_DIR/pkg; put that folder on PYTHONPATH. Wheels are built by nox.
set -euo pipefail
pkg=${1:?package folder name under packages/}; shift
root=$(cd "$(dirname "$0")/.." && pwd)
src="$root/packages/$pkg"
build=${1:-$root/build/dev/$pkg}; shift || true
import_name=${pkg//-/_}
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" "$@" >/dev/null
cmake --build "$build" -j "${DEVBUILD_JOBS:-2}"
rm -rf "$build/pkg/$import_name"
mkdir -p "$build/pkg"
cp -r "$src/src/$import_name" "$build/pkg/$import_name"
cmake --install "$build" --prefix "$build/pkg" >/dev/null
echo "PYTHONPATH=$build/pkg"
