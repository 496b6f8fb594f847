#!/usr/bin/env bash
# One short GPU session. Run from the repository root on a machine with an NVIDIA GPU.
#   benchmarks/gpu.sh          the cuDNN and Pallas checks against XLA, then both benchmark tables on the `auto`
#                              kernel (about 10 minutes on an H200)
#   benchmarks/gpu.sh kernels  the fused-kernel comparison: per method, cudnn vs pallas vs xla at L=512 and 2048
set -uo pipefail
MODE="${1:-all}"
OUT="${OUT:-out}"
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[dev,gpu]' || exit 1
PY=.venv-gpu/bin/python
mkdir -p "$OUT"
$PY -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
if [ "$MODE" = kernels ]; then
  $PY benchmarks/attention.py --methods=absolute,alibi,t5,bert_r,tupe_a,tupe_r,shaw,huang_m4,rope,kerple_log,fire,sandwich,fox \
      --lengths=512,2048 --batch=32 --dtype=bfloat16 --kernels=cudnn,pallas,xla --model_time_max_len=2048 \
      | tee "$OUT/kernels.md"
  # decoder layers: the causal tile skipping, and the data-dependent methods (stick-breaking's own kernels)
  $PY benchmarks/attention.py --methods=none,alibi,fox,stick_breaking,cope --causal --skip_model \
      --lengths=512,2048,8192 --batch=8 --dtype=bfloat16 --kernels=pallas,xla | tee "$OUT/kernels_causal.md"
  exit 0
fi
$PY benchmarks/attention.py --lengths=128,512,2048 --batch=32 --dtype=bfloat16 --kernels=auto \
    --model_time_max_len=512 | tee "$OUT/attention.md"
$PY benchmarks/train_step.py --lengths=128,512 --batch=32 --dtype=bfloat16 --kernels=auto \
    | tee "$OUT/train_step.md"
