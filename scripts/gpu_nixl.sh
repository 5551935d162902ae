#!/usr/bin/env bash
# The second device call of docs/gpu.md, run by `./dev gpu NIXL_WHEELS_DIR --nixl`
# (scripts/gpu_run.sh): NIXL's wheels (nixl-cuXX and the `nixl` alias Ray's RDT
# imports; 57 MiB, more than fits beside the first call's wheels) into the venv the
# first call made on this machine, then the NIXL tests and the benchmark's NIXL rows,
# within the budget gpu_run.sh passes. UCX says which transports it picked
# (RAYDIRECT_NIXL_UCX_INFO=1: UCX_PROTO_INFO) in pytest-nixl.txt and bench-nixl.log.
set -euo pipefail
started=$SECONDS
here=$(cd "$(dirname "$0")/.." && pwd)
wheels=$1
budget=$2
shift 2
python=${PYTHON:-python3}
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=${RAYDIRECT_GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/raydirect/gpu-venv-py$pyver}
vpy="$venv/bin/python"
if [ ! -x "$vpy" ]; then
  echo "gpu_run --nixl: no venv at $venv: run ./dev gpu WHEELS_DIR first, on the same" \
    "machine (the workplace's goes back after 30 s idle: the calls must follow each other)" >&2
  exit 2
fi
results=${OUT:-$here/bench-results/gpu-nixl-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$results"
"$vpy" -m pip install --quiet --no-index --no-deps --force-reinstall --disable-pip-version-check \
  "$wheels"/*.whl 2>&1 | tee "$results/install-nixl.txt"
cd "$here"
export RAYDIRECT_NIXL_UCX_INFO=1
left() { echo $((budget - (SECONDS - started))); }
set +e
timeout -s INT -k 15 $(($(left) - 60)) "$vpy" -m pytest tests/gpu -k nixl -v -p no:cacheprovider \
  --timeout 90 --junitxml="$results/pytest-nixl.xml" 2>&1 | tee "$results/pytest-nixl.txt"
tests_rc=${PIPESTATUS[0]}
bench_args=("$@")
[ ${#bench_args[@]} = 0 ] && bench_args=(--sizes 64MiB,1GiB --repeats 3)
# The benchmark's NIXL rows without UCX's peer error handling (transports/nixl.py
# ucx_settings: with it UCX leaves cuda_ipc out); the tests run both ways.
RAYDIRECT_NIXL_UCX_ERROR_MODE=${RAYDIRECT_NIXL_UCX_ERROR_MODE:-none} \
  timeout -s INT -k 15 $(($(left) - 5)) "$vpy" benchmarks/gpu.py --skip-if-no-gpu --nixl-only \
  --json "$results/bench-nixl.json" --md "$results/bench-nixl.md" "${bench_args[@]}" \
  2>&1 | tee "$results/bench-nixl.log"
bench_rc=${PIPESTATUS[0]}
set -e
echo "gpu_run --nixl: tests exit $tests_rc, benchmark exit $bench_rc; $((SECONDS - started))s;" \
  "results in $results"
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"
