#!/usr/bin/env bash
# One short GPU session: install the CUDA plugin, check the cuDNN path, record both benchmark tables.
# Run from the repository root on a machine with an NVIDIA GPU (about 10 minutes on an H200).
set -euo pipefail
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[dev,gpu]'
PY=.venv-gpu/bin/python
mkdir -p "${OUT:-out}"
$PY -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -5 | tee "${OUT:-out}/gpu_tests.txt"
$PY benchmarks/attention.py --lengths=128,512,2048 --batch=32 --dtype=bfloat16 --kernel=auto \
    --model_time_max_len=512 | tee "${OUT:-out}/attention.md"
$PY benchmarks/train_step.py --lengths=128,512 --batch=32 --dtype=bfloat16 --kernel=auto \
    | tee "${OUT:-out}/train_step.md"
