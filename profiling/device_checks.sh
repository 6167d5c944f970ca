#!/usr/bin/env bash
# The GPU checks of the GPU-speed issue in one command, for a session lent a device machine (its 15 minutes of
# device time cover one start, this script and a rerun):
#
#     bash profiling/device_checks.sh                 # on the device machine, from the repository root
#     DEVICE=cpu bash profiling/device_checks.sh      # a dry run here: every step scaled down, on the CPU
#
# Writes to $OUT (the device tool's folder that comes back; profiling_output/device elsewhere), five files, one
# folder down at most: suite/suite.json and suite/suite.png (profiling.suite: every row of the GPU table),
# suite.txt, forward_check.txt (the forward check's margins in float32, bfloat16, float16) and compiled.txt
# (torch.compile against eager at BERT-base, bf16, B=32), each step's output and exit status, with a time limit
# per step so that one that hangs leaves the others their time (540 s in all, within one device run's 600). The
# device image has torch, transformers, peft and accelerate but no opacus: the suite skips the opacus-ghost column
# (and says so) unless its wheel is carried.
set -u
device=${DEVICE:-cuda}
out=${OUT:-profiling_output/device}
mkdir -p "$out/suite"
python=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME LIMIT_S COMMAND...: the command's output and exit status in $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local status=$?
    echo "[$name: exit $status after $((SECONDS - start)) s, limit $limit s]" | tee -a "$out/$name.txt"
}

if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    step suite 330 "$python" -m profiling.suite --device cuda --out "$out/suite"
    step forward_check 90 "$python" -m profiling.forward_check --device cuda --dtypes float32 bfloat16 float16
    step compiled 120 "$python" -m profiling.compiled --device cuda --hidden 768 --heads 12 --seq 128 --batch 32 \
        --dtype bf16 --threads 0 --steps 30
else
    step suite 300 "$python" -m profiling.suite --tiny --device "$device" --rounds 1 --warmup 1 --out "$out/suite"
    step forward_check 300 "$python" -m profiling.forward_check --device "$device" --dtypes float32 \
        --models "bert (sdpa)" --batches 8
    step compiled 300 "$python" -m profiling.compiled --device "$device" --modes plain bookkeeping \
        --backends none --steps 2 --warmup 1 --layers 1 --hidden 32 --heads 2 --seq 8
fi
