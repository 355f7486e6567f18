#!/usr/bin/env bash
# The checks a session with a GPU runs, in one go (the device machine has torch and pytest but no
# network, so nothing is installed: the checkout runs from PYTHONPATH). Logs go to $OUT
# (/tmp/gpu-check by default):
#   1. the GPU and the doctor's measured matmul rates,
#   2. tests/multigpu (one GPU: the CUDA opt_levels, GradScaler, NCCL and FSDP at world 1, a
#      checkpoint written from the GPU, two gloo ranks sharing the GPU; two or more: NCCL across GPUs),
#   3. the example under torchrun (auto opt_level, a checkpoint and a resume),
#   4. benchmarks/compare.py on the GPU, one rank per GPU.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
"$PY" -m distamp.doctor 2>&1 | tee "$OUT/doctor.txt"

echo "== tests/multigpu"
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 200 "$PY" -m pytest tests/multigpu $XDIST -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/multigpu.txt" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E " | head -80

echo "== the example"
run() { timeout 75 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$GPUS" \
  examples/train_gpt.py --size small --opt-level auto --log-every 20 --progress lines \
  --ckpt-dir "$OUT/ckpt" --save-every 40 --run-dir none "$@" 2>&1; }
run --steps 60 | tee "$OUT/example.txt" | grep -vE "^W[0-9]|^\*+$" | tail -12
run --steps 80 --resume auto | tee -a "$OUT/example.txt" | tail -6
rm -rf "$OUT/ckpt"

echo "== benchmarks/compare.py"
timeout 150 "$PY" benchmarks/compare.py --world "$GPUS" --batch "${BENCH_BATCH:-32}" --steps 20 \
  --warmup 5 --rounds 2 --out-dir "$OUT" --only "FP32 DDP" "torch.autocast + DDP" \
  "distamp O1 + hook" "distamp O2 replicated + hook" "distamp O2 FSDP2 (distamp.fsdp.fully_shard)" \
  "floor: pure bf16, no communication" 2>&1 | grep -vE "^round " | tail -30
