#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark on a CUDA machine with no internet, from
# a folder of wheels made by scripts/gpu_wheels.sh on a connected machine (docs/gpu.md):
#
#   scripts/gpu_run.sh WHEELS_DIR [--slow] [BENCHMARK OPTIONS...]  (or: ./dev gpu WHEELS_DIR ...)
#   scripts/gpu_run.sh NIXL_WHEELS_DIR --nixl     (after the first, on the same machine)
#
# It keeps the machine's CUDA torch: a venv made with --system-site-packages from
# $PYTHON (the interpreter that has torch; when that is a venv itself, its
# site-packages are added too), into which it installs with pip --no-index --no-deps:
# ray, raydirect, pyzmq and (if present) WHEELS_DIR/nixl always; every other wheel
# only where the machine lacks that package or has an older version (numpy only
# where it is missing: the machine's torch was built against its own). It never
# touches .venv, ./dev's CPU venv.
#
# Then, from this checkout:
#   python -m pytest tests/gpu tests/test_cuda.py -v      -> pytest.txt, pytest.xml
#   python benchmarks/gpu.py [BENCHMARK OPTIONS...]      -> bench.md, bench.json, bench.log
# with environment.txt (versions, GPUs, what was installed) beside them, in $OUT if
# set, else bench-results/gpu-<date>-<time>/. Exit status: the tests', else the
# benchmark's.
#
# Time: the whole run fits RAYDIRECT_GPU_BUDGET_S (default 230 s: one device call
# of the workplace's GPU machine, whose 15 minutes include its start and the
# transfers). The tests get what is left minus BENCH_RESERVE_S (70 s) and stop
# (SIGINT: pytest still writes its summary and pytest.xml) when it runs out; the
# benchmark gets the rest and rewrites bench.md and bench.json after every block.
# Every file is written as the run goes, so a run cut short keeps what it did.
# Without options the benchmark is the quick one (1MiB,64MiB,1GiB, 3 repeats, 3
# sync steps) and slow tests skip; --slow runs those tests (RAYDIRECT_GPU_SLOW=1)
# and the benchmark's defaults, with no budget. --nixl: install WHEELS_DIR/*.whl
# (NIXL, carried in a call of its own) into the venv the first call made, then the
# NIXL tests and the benchmark's NIXL rows.
#
# Environment: PYTHON (default python3), RAYDIRECT_GPU_VENV (default
# ~/.cache/raydirect/gpu-venv-py<major.minor>), OUT, RAYDIRECT_GPU_BUDGET_S.
set -euo pipefail
started=$SECONDS
here=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: scripts/gpu_run.sh WHEELS_DIR [--slow | --nixl] [BENCHMARK OPTIONS...]" >&2
  echo "  WHEELS_DIR: the folder scripts/gpu_wheels.sh made (docs/gpu.md)" >&2
  exit 2
fi
wheels=$(cd "$1" && pwd)
shift
mode=quick
case "${1:-}" in --slow | --nixl) mode=${1#--}; shift ;; esac
budget=${RAYDIRECT_GPU_BUDGET_S:-230}
[ "$mode" = slow ] && budget=100000
left() { echo $((budget - (SECONDS - started))); }
if [ "$mode" = nixl ]; then
  exec bash "$here/scripts/gpu_nixl.sh" "$wheels" "$budget" "$@"
fi
if ! ls "$wheels"/ray-*.whl "$wheels"/raydirect-*.whl > /dev/null 2>&1; then
  echo "gpu_run: $wheels has no ray-*.whl or raydirect-*.whl: make it with scripts/gpu_wheels.sh" >&2
  exit 2
fi
python=${PYTHON:-python3}
if ! "$python" -c 'import torch' 2> /dev/null; then
  echo "gpu_run: $python cannot import torch; set PYTHON to the interpreter that has CUDA torch" >&2
  exit 2
fi
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
built_for=$(sed -n 's/^python_version: //p' "$wheels/MANIFEST.txt" 2> /dev/null || true)
if [ -n "$built_for" ] && [ "$built_for" != "$pyver" ]; then
  echo "gpu_run: the wheels are for Python $built_for, $python is $pyver:" \
    "rebuild them with PYTHON_VERSION=$pyver scripts/gpu_wheels.sh" >&2
  exit 2
fi
results=${OUT:-$here/bench-results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$results"
venv=${RAYDIRECT_GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/raydirect/gpu-venv-py$pyver}
vpy="$venv/bin/python"

if [ ! -x "$vpy" ]; then
  echo "gpu_run: creating $venv (--system-site-packages: the machine's torch stays)"
  mkdir -p "$(dirname "$venv")"
  if ! "$python" -m venv --system-site-packages "$venv"; then
    echo "gpu_run: could not create a venv with $python (Debian/Ubuntu: apt install" \
      "python$pyver-venv), or point RAYDIRECT_GPU_VENV at an existing one" >&2
    exit 2
  fi
  # A $PYTHON that is itself a venv: --system-site-packages reaches only its base
  # interpreter, so add the venv's own site-packages (after ours, .pth files included).
  "$python" - "$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" << 'EOF'
import os
import sys
import sysconfig

if sys.prefix != sys.base_prefix:
    dirs = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    with open(os.path.join(sys.argv[1], "_raydirect_gpu_parent.pth"), "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in dirs)
EOF
fi

# Which wheels this machine needs (see the header).
chosen=()
while IFS= read -r line; do
  chosen+=("$line")
done < <("$vpy" - "$wheels" << 'EOF'
import importlib.metadata as md
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
always = {"ray", "raydirect", "pyzmq"}


def older(have, version):
    try:
        from packaging.version import Version

        return Version(have) < Version(version)
    except Exception:  # no packaging here, or a version it cannot read

        def parts(v):
            return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+-]", v))

        return parts(have) < parts(version)


for path in sorted(root.glob("*.whl")) + sorted(root.glob("nixl/*.whl")):
    name, version = path.name.split("-")[:2]
    name = re.sub(r"[-_.]+", "-", name).lower()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if name in always or path.parent.name == "nixl" or have is None:
        print(path)
    elif name != "numpy" and older(have, version):
        print(path)
EOF
)
echo "gpu_run: installing ${#chosen[@]} wheels into $venv"
"$vpy" -m pip install --quiet --no-index --no-deps --force-reinstall --disable-pip-version-check \
  "${chosen[@]}" 2>&1 | tee "$results/install.txt"

cd "$here"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "checkout: $(git rev-parse HEAD 2> /dev/null || echo unknown)"
  echo "wheels: $wheels"
  echo "installed:"
  printf '  %s\n' "${chosen[@]##*/}"
  "$vpy" - << 'EOF'
import importlib.util
import pathlib
import platform

import ray
import torch

import raydirect

print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
print(f"ray {ray.__version__}, raydirect {raydirect.__version__} from {raydirect.__file__}")
print("nixl:", [m for m in ("nixl", "nixl_cu12") if importlib.util.find_spec(m)] or "not installed")
if torch.cuda.is_available():
    print("GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
else:
    print("GPUs: none visible to torch: the tests will skip and the benchmark will say so")
# The wheel should be this checkout's code: say so loudly when it is not.
src, installed = pathlib.Path("src/raydirect"), pathlib.Path(raydirect.__file__).parent
differ = [
    str(p.relative_to(src))
    for p in sorted(src.rglob("*.py"))
    if not (installed / p.relative_to(src)).is_file()
    or (installed / p.relative_to(src)).read_bytes() != p.read_bytes()
]
if differ:
    print(f"WARNING: the installed raydirect differs from this checkout's src/ in {differ[:5]}"
          f"{' and more' if len(differ) > 5 else ''}: rebuild the wheels (scripts/gpu_wheels.sh)")
else:
    print("raydirect: the installed wheel matches this checkout's src/")
EOF
  nvidia-smi 2> /dev/null || echo "nvidia-smi: not available"
} 2>&1 | tee "$results/environment.txt"

bench_args=("$@")
if [ "$mode" = quick ] && [ ${#bench_args[@]} = 0 ]; then
  bench_args=(--sizes 1MiB,64MiB,1GiB --repeats 3 --sync-steps 3 --no-nixl)
fi
[ "$mode" = slow ] && export RAYDIRECT_GPU_SLOW=1
set +e
tests_s=$(($(left) - ${BENCH_RESERVE_S:-70}))
echo "gpu_run: tests, at most ${tests_s}s ($(left)s of the budget left)"
timeout -s INT -k 15 "$tests_s" "$vpy" -m pytest tests/gpu tests/test_cuda.py -v \
  -p no:cacheprovider --timeout 90 --junitxml="$results/pytest.xml" 2>&1 | tee "$results/pytest.txt"
tests_rc=${PIPESTATUS[0]}
bench_s=$(($(left) - 5))
echo "gpu_run: benchmark ${bench_args[*]}, at most ${bench_s}s"
timeout -s INT -k 15 "$bench_s" "$vpy" benchmarks/gpu.py --skip-if-no-gpu \
  --json "$results/bench.json" --md "$results/bench.md" "${bench_args[@]}" \
  2>&1 | tee "$results/bench.log"
bench_rc=${PIPESTATUS[0]}
set -e

echo
echo "gpu_run: tests exit $tests_rc, benchmark exit $bench_rc (124: cut at the budget);" \
  "$((SECONDS - started))s in all; results in $results"
if [ "$tests_rc" -ne 0 ]; then
  exit "$tests_rc"
fi
exit "$bench_rc"
