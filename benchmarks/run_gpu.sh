#!/usr/bin/env bash
# The measurements that need a GPU, in one go (issues #13 and #14): each writes its output under
# OUTDIR, one file per measurement, and a failure of one does not stop the others.
#
#   bash benchmarks/run_gpu.sh OUTDIR [GROUP ...]     (PYTHON=python3 by default)
#
# GROUPs (all by default; a device call of at most 10 minutes takes one or two):
# - step: gpu_step_<model>.txt: `benchmarks/gpu_step.py` (vitray's training step vs a plain AMP loop over
#   timm's ViT) for B/16, S/16, L/16 and H/14 (the last two with activation checkpointing);
# - attention: attention.txt: the attention kernel `train.attention=auto` runs for ViT-B/16 in bf16;
# - data: data_pipeline.txt: `benchmarks/data_pipeline.py` with one loader worker per core but two;
# - pretrain: pretrain.txt: a real `vitray pretrain` on CUDA (Ray, DeepSpeed ZeRO-1, bf16, compiled), B/16 at
#   224 px on the built-in digits for 300 steps: checks that nothing in the run is CPU-only;
# - decode (issue #24's goal for a real run): pretrain_decode.txt: `benchmarks/pretrain_decode.py`, B/16 batch
#   256 on 12,000 ImageNet-size JPEGs with data.decode=gpu then cpu and the loader as the run resolves it,
#   each against gpu_step_B16's vitray step rate (measured after the JPEGs are written and sharded, so that
#   nothing competes with it for the CPUs; the step group's B/16 figure is reused when both groups run).
#   About 8 minutes.
# - remat: remat_<model>.txt: `benchmarks/remat.py` (activation checkpointing's two `model.remat_policy`s and no
#   checkpointing: step time and peak memory) for L/16 and H/14, compiled, then `gpu_step.py` for H/14 with vitray on
#   `dots_saveable` against the plain loop's whole-block recompute (its own row, not the issue's comparison).
# - checks: checks.txt: the CUDA variants of the feed's and the GPU decode's tests (tests/test_feed.py and
#   tests/test_device_decode.py, `-k cuda`: the feed's thread, pinned copies on the side stream, nvjpeg, the crops
#   on the GPU against the CPU path's). About 1 minute.
# - graphs: gpu_step_<model>_graphs.txt: `gpu_step.py --compile-mode reduce-overhead` (CUDA graphs, both loops) for
#   S/16 and B/16, to hold against the step group's default-mode figures (and their last losses). About 4 minutes.
# - fp8 (issue #40's item 4): fp8_step_<model>.txt: `gpu_step.py --dtypes bf16,fp8` for L/16 and H/14 (activation
#   checkpointing): vitray in bf16 (L/16) and in fp8 against the plain bf16 loop (L/16
#   profiled: where the fp8 step's device time goes, the casts against the products); fp8_loss.txt: `benchmarks/fp8_loss.py`,
#   B/16 for 500 steps in bf16 then fp8 from the same seed and batches, and their losses (the fp8 loops compile for over a minute each). About 13 minutes: two device calls.
# Budget: about 20 minutes on one H100 for the first four (each step has its own time limit).
# The kit: `make gpu-kit` (benchmarks/gpu_kit.sh: the shared kit with every vitray sub-package linked, torchao
# for the device's torch, pytest for `checks`); each device call starts `source .gpu-kit/env.sh || exit 1;`.
set -u
OUT=${1:?usage: run_gpu.sh OUTDIR [attention] [step] [data] [pretrain] [decode] [remat] [graphs] [checks] [fp8]}
shift
GROUPS_WANTED=${*:-attention step data pretrain}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

wanted() { [[ " $GROUPS_WANTED " == *" $1 "* ]]; }

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output to OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "   exit $rc; last lines:" >>"$OUT/summary.txt"
    tail -n 6 "$OUT/$name.txt" >>"$OUT/summary.txt"
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
wanted attention && step attention 120 "$PY" -c "
import torch
from vitray.trainers.step.attention import attention_kernel
for setting in ('auto', 'flash', 'cudnn', 'efficient'):
    try:
        kernel = attention_kernel(setting, tokens=197, heads=12, head_dim=64, dtype=torch.bfloat16, device=torch.device('cuda'))
    except ValueError as err:
        kernel = f'refused: {err}'
    print(f'B/16 bf16 train.attention={setting}: {kernel}')
"
wanted checks && step checks 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_feed.py tests/test_device_decode.py -k cuda
if wanted decode; then  # the JPEGs and shards for the decode group, before any step is timed
    DECODE_WORK=$(mktemp -d)
    step decode_prepare 300 "$PY" benchmarks/pretrain_decode.py --workdir "$DECODE_WORK" --decode ""
fi
if wanted step || wanted decode; then
    step gpu_step_B16 420 "$PY" benchmarks/gpu_step.py --model B/16 --batch 256 --steps 30 --warmup 10
fi
wanted step && step gpu_step_S16 300 "$PY" benchmarks/gpu_step.py --model S/16 --batch 256 --steps 40 --warmup 10
wanted step && step gpu_step_L16 420 "$PY" benchmarks/gpu_step.py --model L/16 --batch 128 --steps 20 --warmup 8 --grad-checkpointing --profile 2
wanted step && step gpu_step_H14 420 "$PY" benchmarks/gpu_step.py --model H/14 --batch 64 --steps 12 --warmup 6 --grad-checkpointing --profile 2
wanted remat && step remat_L16 240 "$PY" benchmarks/remat.py --model L/16 --batch 128 --compile
wanted remat && step remat_H14 300 "$PY" benchmarks/remat.py --model H/14 --batch 64 --compile --steps 2
wanted remat && step gpu_step_H14_dots 420 "$PY" benchmarks/gpu_step.py --model H/14 --batch 64 --steps 12 --warmup 6 \
    --grad-checkpointing --remat-policy dots_saveable
wanted graphs && step gpu_step_S16_graphs 300 "$PY" benchmarks/gpu_step.py --model S/16 --batch 256 --steps 40 \
    --warmup 10 --compile-mode reduce-overhead
wanted graphs && step gpu_step_B16_graphs 300 "$PY" benchmarks/gpu_step.py --model B/16 --batch 256 --steps 30 \
    --warmup 10 --compile-mode reduce-overhead
wanted fp8 && step fp8_step_L16 360 "$PY" benchmarks/gpu_step.py --model L/16 --batch 128 --steps 12 --warmup 5 \
    --grad-checkpointing --dtypes bf16,fp8 --profile 2
wanted fp8 && step fp8_step_H14 300 "$PY" benchmarks/gpu_step.py --model H/14 --batch 64 --steps 8 --warmup 4 \
    --grad-checkpointing --dtypes fp8
wanted fp8 && step fp8_loss 240 "$PY" benchmarks/fp8_loss.py --model B/16 --batch 128 --steps 500
wanted data && step data_pipeline 420 "$PY" benchmarks/data_pipeline.py --workers "$(($(nproc) - 2))" --skip-s3

if wanted pretrain; then
DATA=$(mktemp -d)/digits
step prepare 120 "$PY" -m vitray.cli data prepare builtin:digits "$DATA"
step pretrain 540 "$PY" -m vitray.cli pretrain --set run.name=gpu-check --set run.storage="$(mktemp -d)" \
    --set data.train="$DATA" --set model.name=B/16 --set model.img_size=224 --set train.steps=300 \
    --set train.batch_size=256 --set train.micro_batch_size=256 --set schedule.warmup_steps=30 \
    --set precision.dtype=bf16 --set cluster.num_workers=1 --set cluster.gpus_per_worker=1 --set data.num_slots=8 \
    --set data.num_workers="$(($(nproc) - 4))" --set data.min_crop_area=0.5 --set log.every=50 \
    --set checkpoint.every=150
fi
if wanted decode; then
    RATE=$(sed -n 's/^vitray pretrain step[^:]*: \([0-9.]*\) img\/s.*/\1/p' "$OUT/gpu_step_B16.txt")
    step pretrain_decode 480 "$PY" benchmarks/pretrain_decode.py --workdir "$DECODE_WORK" --steps 150 \
        --run-timeout 200 ${RATE:+--step-rate "$RATE"}
fi
echo "done $(date -u +%H:%M:%S)" >>"$OUT/summary.txt"
