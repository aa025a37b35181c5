#!/usr/bin/env bash
# Train the deep family's source and target at once on one CUDA GPU (two processes; the models are small enough
# that each leaves most of the GPU idle), each fitted to a wall-clock budget; each export is packed as soon as its
# model finishes. Usage (from the repo root):
#   bash research/family_builder/train_deep_gpu.sh OUT_DIR [SOURCES_DIR] [BUDGET_MIN] [TRAIN_DEEP_ARGS...]
# OUT_DIR receives source.tgz, target.tgz (bf16 checkpoints with the tokenizer, done.json inside) and both logs.
# MODELS="target" trains one of them; TRAIN_DEEP_ARGS go to train_deep.py as they are, e.g. a target trained
# without the previous-token loss (where does copying form when nothing pins it?):
#   MODELS=target bash research/family_builder/train_deep_gpu.sh OUT_DIR SOURCES_DIR 10 --prev-token-aux-weight 0
set -u
out=${1:?usage: train_deep_gpu.sh OUT_DIR [SOURCES_DIR] [BUDGET_MIN] [TRAIN_DEEP_ARGS...]}
src=${2:-/usr/share/doc/python3.11/html/_sources}
budget=${3:-7.5}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
train() {  # name batch [TRAIN_DEEP_ARGS...]
  local name=$1 batch=$2 w=/tmp/deep_gpu/$1
  shift 2
  python research/family_builder/train_deep.py --device "${DEVICE:-cuda}" --models "$name" --run-dir "$w/run" \
    --export-dir "$w/export" --sources-dir "$src" --batch-size "$batch" --steps 30000 --probe-every 500 \
    --checkpoint-minutes 100 --time-budget-min "$budget" "$@" > "$w.out" 2>&1
  cp "$w/run/$name/done.json" "$w/export/$name/" 2>/dev/null
  tar czf "$out/$name.tgz" -C "$w/export" "$name" && echo "$name packed"
}
models=${MODELS:-source target}
mkdir -p /tmp/deep_gpu
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for n in $models; do train "$n" 8 "$@" & done
while [ -n "$(jobs -r)" ]; do
  for n in $models; do cp /tmp/deep_gpu/$n/run/train_log.txt "$out/${n}_log.txt" 2>/dev/null; done
  sleep 15
done
wait
for n in $models; do cp /tmp/deep_gpu/$n/run/train_log.txt "$out/${n}_log.txt"; tail -3 /tmp/deep_gpu/$n.out; done
ls -la "$out"
