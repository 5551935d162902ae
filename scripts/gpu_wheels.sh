#!/usr/bin/env bash
# Builds the folder of wheels that scripts/gpu_run.sh installs on a CUDA machine
# with no internet (docs/gpu.md). Run it here, on a machine WITH internet, from a
# checkout (any Python 3.10+ runs pip; the wheels are for the GPU machine's Python):
#
#   scripts/gpu_wheels.sh [OUT_DIR]          default OUT_DIR: dist/gpu-wheels
#
# Environment:
#   PYTHON_VERSION  the GPU machine's Python, major.minor (default 3.12)
#   PLATFORMS       pip --platform tags, space-separated
#                   (default: manylinux2014_x86_64 manylinux_2_17/27/28_x86_64)
#   NIXL=0          leave out the optional NIXL wheels
#   NIXL_CUDA       12 or 13: the CUDA major of the GPU machine's torch (default 12)
#   SET=device      only what the workplace's GPU machine lacks (docs/gpu.md, "On the
#                   workplace's GPU machine"): ray repacked, pyzmq, jsonschema and its
#                   three dependencies, cryptography with cffi and pycparser, raydirect;
#                   everything --no-deps. About 52 MiB, under the 64 MiB one device call
#                   carries; NIXL (56 MiB) goes in a second call. Checked against the
#                   machine's package list (scripts/gpu_wheels_check.py, which fails
#                   naming what is missing)
#   CHECK_ONLY=1    download nothing: only check that SET's list covers what the GPU run
#                   imports beyond the machine's packages (SET=device; runs here, offline)
#   PYTHON          the interpreter that runs pip here (default python3)
#
# What goes in OUT_DIR: ray (the version pyproject.toml pins, repacked without its
# Java jars by scripts/gpu_repack.py, which says why the dashboard build stays),
# every dependency of ray[default], pyzmq, numpy, pytest and pytest-timeout;
# raydirect itself (pip wheel --no-deps .); and in OUT_DIR/nixl the optional NIXL
# wheels (nixl-cu12, and the small `nixl` alias that Ray's RDT
# imports). Never torch, triton or CUDA libraries: the GPU machine keeps its own.
# MANIFEST.txt records the Python version, platforms, commit and checksums.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/dist/gpu-wheels}
# What the workplace's GPU machine lacks (scripts/gpu_machine_packages.txt is what it
# has): Ray itself, pyzmq, Ray's jsonschema and its three, and cryptography (the stream
# port's TLS, imported by raydirect._frames) with cffi and pycparser under it.
device_set=(pyzmq jsonschema jsonschema-specifications referencing rpds-py cryptography cffi
  pycparser)
pyver=${PYTHON_VERSION:-3.12}
platforms=${PLATFORMS:-manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64}
python=${PYTHON:-python3}
abi="cp${pyver/./}"
machine_list="$here/scripts/gpu_machine_packages.txt"
check() {  # check ARGS...: the wheels (--wheels DIR) or a list (--carried ...) cover the run
  "$python" "$here/scripts/gpu_wheels_check.py" --machine "$machine_list" \
    --python-version "$pyver" "$@"
}
if [ "${CHECK_ONLY:-0}" = 1 ]; then
  if [ "${SET:-full}" != device ]; then
    echo "gpu_wheels: CHECK_ONLY checks the SET=device list; the full set carries every dependency" >&2
    exit 2
  fi
  check --carried ray "${device_set[@]}"
  exit
fi

# The dependency specs, as pyproject.toml writes them (e.g. "ray[default]>=2.60,<2.61").
spec() { sed -n "s/.*\"\\($1[^\"]*\\)\".*/\\1/p" "$here/pyproject.toml" | head -n 1; }
ray_spec=$(spec 'ray\[default\]')
zmq_spec=$(spec 'pyzmq')
nixl_spec=$(spec 'nixl-cu12')
nixl_spec=${nixl_spec/cu12/cu${NIXL_CUDA:-12}}
for value in "$ray_spec" "$zmq_spec" "$nixl_spec"; do
  if [ -z "$value" ]; then
    echo "gpu_wheels: could not read the ray, pyzmq and nixl-cu12 specs from pyproject.toml" >&2
    exit 1
  fi
done

mkdir -p "$out"
rm -rf "$out"/*.whl "$out/nixl" "$out/MANIFEST.txt"

platform_args=()
for p in $platforms; do
  platform_args+=(--platform "$p")
done
download() {  # download DEST PIP_ARGS...: binary wheels for the GPU machine's Python
  local dest=$1
  shift
  "$python" -m pip download --quiet --dest "$dest" --only-binary=:all: \
    --python-version "$pyver" --implementation cp --abi "$abi" "${platform_args[@]}" "$@"
}

if [ "${SET:-full}" = device ]; then
  # The GPU machine has Ray's other dependencies, numpy and pytest (its KINDS.md list).
  echo "gpu_wheels: ${ray_spec%%\[*} and ${device_set[*]} for Python $pyver, no dependencies"
  pinned=("ray${ray_spec#ray\[default\]}" "$zmq_spec" "$(spec 'cryptography')")
  for name in "${device_set[@]}"; do  # pyproject.toml's specs for those it names
    case "$name" in pyzmq | cryptography) ;; *) pinned+=("$name") ;; esac
  done
  download "$out" --no-deps "${pinned[@]}"
else
  echo "gpu_wheels: $ray_spec, $zmq_spec and their dependencies for Python $pyver ($platforms)"
  download "$out" "$ray_spec" "$zmq_spec" numpy "pytest>=8" "pytest-timeout>=2.3"
fi
# Nothing above needs them, but never ship a second torch or CUDA stack.
rm -f "$out"/torch-*.whl "$out"/triton-*.whl "$out"/nvidia_*.whl

echo "gpu_wheels: repacking ray without ray/jars"
for wheel in "$out"/ray-*.whl; do
  "$python" "$here/scripts/gpu_repack.py" "$wheel"
done

echo "gpu_wheels: raydirect from $here"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$out" "$here"

if [ "${NIXL:-1}" != 0 ]; then
  # The `nixl` alias Ray's RDT imports (12 KiB, pure Python: it imports the nixl_cuXX
  # that matches torch's CUDA), pinned to nixl-cuXX's version, for NIXL_CUDA=12 and 13.
  alias_pkg="nixl==$(sed -n 's/.*>=\([0-9.]*\).*/\1/p' <<< "$nixl_spec")"
  echo "gpu_wheels: NIXL ($nixl_spec, $alias_pkg) into $out/nixl"
  mkdir -p "$out/nixl"
  # --no-deps: nixl-cu1x needs only torch and numpy; the `nixl` alias would pull
  # both CUDA variants as well.
  if ! download "$out/nixl" --no-deps "$nixl_spec" "$alias_pkg"; then
    echo "gpu_wheels: warning: no NIXL wheels for Python $pyver; the NIXL tests and rows will skip" >&2
  fi
fi

if [ "${SET:-full}" = device ]; then
  check --wheels "$out"  # fails naming what the GPU machine would lack
fi

{
  echo "python_version: $pyver"
  echo "platforms: $platforms"
  echo "ray: $ray_spec"
  echo "commit: $(git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)$(
    git -C "$here" diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "made: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "sha256:"
  (cd "$out" && find . -name '*.whl' | sort | xargs sha256sum)
} > "$out/MANIFEST.txt"

count=$(find "$out" -name '*.whl' | wc -l)
echo "gpu_wheels: $count wheels, $(du -sh "$out" | cut -f1), in $out"
echo "gpu_wheels: copy $out and this checkout to the GPU machine, then run there:"
echo "  ./dev gpu $(basename "$out")      (or: scripts/gpu_run.sh PATH/TO/$(basename "$out"))"
