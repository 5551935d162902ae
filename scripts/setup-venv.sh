#!/usr/bin/env bash
# Creates .venv with everything raydirect, its tests and benchmarks need.
# Idempotent: a second run only checks. torch is pinned first so pip takes the
# CPU build that lies on this machine's disk instead of a multi-GB CUDA build.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv="$here/.venv"
stamp="$venv/.raydirect-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# RAYDIRECT_TEST_NIXL=1 adds NIXL (the nixl extra) so the NIXL tests run too.
extras="test"
[ "${RAYDIRECT_TEST_NIXL:-0}" = "1" ] && extras="test,nixl" && stamp="$venv/.raydirect-installed-nixl"
if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -e "$here[$extras]"
  touch "$stamp"
fi
