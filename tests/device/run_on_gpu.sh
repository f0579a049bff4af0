#!/usr/bin/env bash
# The GPU check of issue 19 (CUDA devices), in one command on a lent GPU machine (the `run` tool's
# nvidia-h200: torch, transformers, attrs, hypothesis, safetensors, pytest there; no network).
#
# 1. Here, from the repo root:  PYTHON=/work/main/.venv/bin/python bash tests/device/fetch_wheels.sh
# 2. run tool:  command "bash tests/device/run_on_gpu.sh", carry [".whl"], timeout_s 540
#    (the session's checkout is what travels: merge this branch into it first).
# It prints the CUDA test results, then gpu_check.py's table (the last lines of the output);
# logs and gpu_check.json land in $OUT. The two timeouts below keep it under 8 min (a lease has
# 15 min of device time; the first run took 4.4 min, the machine's start 0.5 min).
# DRY_RUN=1 PY=/work/main/.venv/bin/python runs the same steps on a CPU (CUDA tests skipped, gpu_check.py --dry-run) to check the script itself.
PY=${PY:-python3}
DRY=${DRY_RUN:-0}
set -uo pipefail
OUT=${OUT:-/tmp/neuronfx-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export NEURONFX_CACHE_DIR=/tmp/neuronfx-cache
SITE=/tmp/neuronfx-site
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD"
else
  echo "no .whl/: run tests/device/fetch_wheels.sh here first and carry .whl" >&2
  export PYTHONPATH="$PWD"
fi
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, cattrs, neuronfx; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(), 'cattrs', cattrs.__file__, 'neuronfx', neuronfx.__file__)" || exit 1
EXTRA=()
[ "$DRY" = 1 ] && EXTRA=(--dry-run)
rc=0
# 1. The device-parametrized tests, CUDA cases included (tiny models vs transformers on CUDA, CUDA graphs).
timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_device.py 2>&1 | tee "$OUT/pytest.log" || rc=1
# 2. SmolLM2-135M-shaped greedy check (fp32) and the benchmark table (bf16).
timeout 330 "$PY" tests/device/gpu_check.py "${EXTRA[@]}" --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" || rc=1
exit $rc
