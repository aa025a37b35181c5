#!/usr/bin/env bash
# Train the deep family's source and target at once on one CUDA GPU (two processes; the models are small enough
# that each leaves most of the GPU idle), each fitted to a wall-clock budget; each export is packed as soon as its
# model finishes. Usage (from the repo root):
#   bash research/family_builder/train_deep_gpu.sh OUT_DIR [SOURCES_DIR] [BUDGET_MIN]
# OUT_DIR receives source.tgz, target.tgz (bf16 checkpoints with the tokenizer, done.json inside) and both logs.
set -u
out=${1:?usage: train_deep_gpu.sh OUT_DIR [SOURCES_DIR] [BUDGET_MIN]}
src=${2:-/usr/share/doc/python3.11/html/_sources}
budget=${3:-7.5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
train() {  # name batch
  local w=/tmp/deep_gpu/$1
  python research/family_builder/train_deep.py --device "${DEVICE:-cuda}" --models "$1" --run-dir "$w/run" \
    --export-dir "$w/export" --sources-dir "$src" --batch-size "$2" --steps 30000 --probe-every 500 \
    --checkpoint-minutes 100 --time-budget-min "$budget" > "$w.out" 2>&1
  cp "$w/run/$1/done.json" "$w/export/$1/" 2>/dev/null
  tar czf "$out/$1.tgz" -C "$w/export" "$1" && echo "$1 packed"
}
mkdir -p /tmp/deep_gpu
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
train source 8 & train target 8 &
while [ -n "$(jobs -r)" ]; do
  for n in source target; do cp /tmp/deep_gpu/$n/run/train_log.txt "$out/${n}_log.txt" 2>/dev/null; done
  sleep 15
done
wait
for n in source target; do cp /tmp/deep_gpu/$n/run/train_log.txt "$out/${n}_log.txt"; tail -3 /tmp/deep_gpu/$n.out; done
ls -la "$out"
