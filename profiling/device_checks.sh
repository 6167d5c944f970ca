#!/usr/bin/env bash
# The GPU checks of the GPU-speed issue, for a session lent a device machine (15 minutes of device time, the
# machine's start included):
#
#     bash profiling/device_checks.sh                        # on the device machine: suite, forward_check, pass_two
#     bash profiling/device_checks.sh layers knobs           # any steps by name: suite forward_check pass_two
#                                                            # compiled layers knobs one_backward audit
#     SUITE_ARGS="--against REF" bash profiling/device_checks.sh suite   # extra arguments for the suite
#     DEVICE=cpu bash profiling/device_checks.sh suite forward_check compiled layers knobs one_backward audit  # dry run
#
# Steps, each with its output and exit status in $OUT/NAME.txt (the device tool's folder that comes back;
# profiling_output/device elsewhere) and its own time limit, so that one that hangs leaves the others their time:
# - suite (limit 300 s): profiling.suite, every row of the GPU table; suite/suite.json and suite/suite.png, the
#   JSON rewritten after every row. 238 s on an H200 with Opacus (2026-11-26).
# - forward_check (60 s): the forward check's margins in float32, bfloat16 and float16. 21 s there.
# - pass_two (60 s): tests/privacy/test_pass_two.py on the GPU: whether pass 2 of two passes receives the output
#   grads pass 1 received, bit for bit (where not, the layout proof's steps find it and every later step scales its
#   clipped sums to stay within C, at a cost in time: pass_two.py), and the float32 bound on raw-input attention.
#   Not yet run on a device; its answer says whether ghost's steps on GPUs take the scaled pass 2 from the start.
# - compiled (300 s): torch.compile against eager at BERT-base, bf16, B=32, each setting in its own process.
#   288 s there, so it is not in the default: the default's 420 s and a machine's start (about 30 s) leave a
#   15-minute session room for a rerun.
# - layers (120 s): profiling.layers at BERT-base, bf16, B=256, all trainable: a step split into regions by CUDA
#   events (forward, pass 1's norm rules by module type and its backward, pass 2 or the clipped sums, optimizer),
#   and the LayerNorm and Linear rules against their floors, back to back and by their kernels' durations.
#   Trainable: on the H200 (2026-11-26) trainable embeddings added 14-16 ms to a private step at B=256 against
#   plain's 1.8 ms, which no CPU reading explains. Not yet timed on a device.
# - knobs (150 s): profiling.knobs at BERT-base, bf16, B=32, frozen: DeferredGrams' budget x2 and x4 and the
#   queue bound x4 against the shipped settings, time, working set and ATen ops. Not yet timed on a device.
# - one_backward (150 s): profiling.one_backward at BERT-base (bf16, T=128, B=32) and GPT-2 small with its LM head
#   (bf16, T=256, B=8): what book-keeping keeps against what the graph saved, the mode two passes then take
#   (modes.KEPT_OF_SAVED), and the working set of two passes, book-keeping and ghost. Not yet run on a device.
# - audit (300 s): the sensitivity audit's bound on the GPU (tests/privacy/test_sensitivity_audit.py, one example moves
#   the clipped sum by at most C, float64 and float32 without TF32, both modes, every architecture): its cuDNN and
#   cuBLAS kernels, and the rules that have not met a GPU yet (transposed convolutions, PReLU, EmbeddingBag's mode
#   "max": 2026-11-28). Not yet timed on a device; about a minute on two CPU cores.
# The device image has torch, transformers, peft and accelerate but no opacus: the suite skips the opacus-ghost
# column (and says so) unless its wheel is carried and installed first (pip install --no-deps opacus-*.whl).
set -u
device=${DEVICE:-cuda}
out=${OUT:-profiling_output/device}
mkdir -p "$out/suite"
python=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # unbuffered: a step stopped at its limit keeps its output
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(suite forward_check pass_two)

step() {  # step NAME LIMIT_S COMMAND...: the command's output and exit status in $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local status=$?
    echo "[$name: exit $status after $((SECONDS - start)) s, limit $limit s]" | tee -a "$out/$name.txt"
}

[ "$device" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for name in "${steps[@]}"; do
    case "$name:$device" in
        suite:cuda) step suite 300 "$python" -m profiling.suite --device cuda --out "$out/suite" ${SUITE_ARGS:-} ;;
        suite:*) step suite 300 "$python" -m profiling.suite --tiny --device "$device" --rounds 1 --warmup 1 \
            --out "$out/suite" ${SUITE_ARGS:-} ;;
        forward_check:cuda) step forward_check 60 "$python" -m profiling.forward_check --device cuda \
            --dtypes float32 bfloat16 float16 ;;
        forward_check:*) step forward_check 300 "$python" -m profiling.forward_check --device "$device" \
            --dtypes float32 --models "bert (sdpa)" --batches 8 ;;
        pass_two:*) step pass_two 60 "$python" -m pytest -q -p no:cacheprovider tests/privacy/test_pass_two.py \
            --device "$device" ;;
        compiled:cuda) step compiled 300 "$python" -m profiling.compiled --device cuda --hidden 768 --heads 12 \
            --seq 128 --batch 32 --dtype bf16 --threads 0 --steps 30 ;;
        compiled:*) step compiled 300 "$python" -m profiling.compiled --device "$device" --modes bookkeeping \
            --backends none --steps 2 --warmup 1 --layers 1 --hidden 32 --heads 2 --seq 8 ;;
        layers:cuda) step layers 120 "$python" -m profiling.layers --device cuda --layers 12 --hidden 768 \
            --heads 12 --batch 256 --dtype bf16 --skip-gram ;;
        layers:*) step layers 300 "$python" -m profiling.layers --device "$device" --layers 1 --hidden 32 --heads 2 \
            --vocab 64 --seq 8 --batch 2 --steps 1 --warmup 1 --skip-gram --skip-rules ;;
        knobs:cuda) step knobs 150 "$python" -m profiling.knobs --device cuda --batch 32 --freeze-embeddings \
            --knobs deferred=2,4 queue=4 ;;
        knobs:*) step knobs 300 "$python" -m profiling.knobs --tiny --device "$device" --rounds 1 --warmup 0 \
            --knobs deferred=4 ;;
        one_backward:cuda) step one_backward 150 bash -c "$python -m profiling.one_backward --device cuda --model bert \
            --layers 12 --hidden 768 --heads 12 --vocab 30522 --seq 128 --batch 32 --dtype bf16 && $python -m \
            profiling.one_backward --device cuda --model gpt2-lm --layers 12 --hidden 768 --heads 12 --vocab 50257 \
            --seq 256 --batch 8 --dtype bf16" ;;
        one_backward:*) step one_backward 300 "$python" -m profiling.one_backward --device "$device" --model linear \
            --layers 1 --hidden 16 --seq 4 --batch 4 ;;
        audit:cuda) step audit 300 "$python" -m pytest -q -p no:cacheprovider tests/privacy/test_sensitivity_audit.py \
            -k one_example --device cuda ;;
        audit:*) step audit 300 "$python" -m pytest -q -p no:cacheprovider tests/privacy/test_sensitivity_audit.py \
            -k "one_example and cnn-prelu" --device "$device" ;;
        *) echo "unknown step '$name': the steps are suite, forward_check, pass_two, compiled, layers, knobs," \
                "one_backward and audit" >&2
           exit 2 ;;
    esac
done
