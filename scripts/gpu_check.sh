#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU and no network, from a checkout of this repository,
# run the attention benchmark (the Zformer reference's grid, bf16 and fp32, and long inputs; CUDA-graph
# replays, the GPU's own time, and eager calls, host work included; the attention alone and whole
# modules with their output projection), the decoding benchmark, the kernel tests on CUDA, the
# device tests, the sequence-operation benchmark, compiled modules (their tests and a training
# grid under torch.compile(mode="reduce-overhead")) and what each kernel asks of the GPU as this
# machine's triton compiles it (scripts/compile_kernels.py), and write every result into one folder
# (archived again after each step, so a run cut short still leaves what it measured), with
# acceptance.md: what has run so far against the kernels' bars (scripts/gpu_report.py).
#
#     bash scripts/gpu_check.sh [OUTPUT_DIR]          # default gpu_check/; at most 8 minutes
#     BUDGET=0 bash scripts/gpu_check.sh              # every step to its end: about 25 minutes on an H100/H200
#
# Steps run most important first, each under its own time limit, within BUDGET seconds for the whole
# check (default 460; 0 = none): a step gets at most what is left, and once too little is left the
# remaining steps are listed in summary.txt as not run. A step stopped at its limit keeps what it
# measured: the benchmarks write the cases and tokens timed so far (the rest recorded as not
# measured) and pytest reports the tests that ran. Python packages the machine lacks
# can sit as wheel files in .whl/ (e.g. transformers, fla-core, datasets): they are installed into a
# private folder, nothing else is touched; `bash scripts/gpu_prepare.sh` gathers them, and the data
# of the training scripts' throughput steps (gpu_data/), before the machine is reached. HF_ZFORMER_COMMIT names the commit where the checkout has no git
# history; PYTHON the interpreter (default python3); STEPS="kernel_tests grid_bf16 ..." runs only the
# steps named; FLA=1 adds flash-linear-attention's causal kernel against ours and its tests (fla
# tunes itself on the first call of every shape: minutes more); QUICK=1 runs every step at toy
# sizes (a dry run of the script itself, also on a CPU; no BUDGET unless one is given). DECODE=1024 MARKS=256,512,1024 sets the decoding
# benchmark's length and reported points; TRAIN_STEPS the training scripts' steps (default 300);
# KERNEL_TESTS / DEVICE_TESTS a pytest -k expression narrowing those two steps; PREFIXES the decoder
# prefixes of the long-context decoding steps (default "4096 32768"); ARCHIVE the archive's path
# (default OUTPUT_DIR.tar.gz; it is rewritten after every step, so a run cut short keeps what it measured).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
archive=${ARCHIVE:-$out.tar.gz}
python=${PYTHON:-python3}
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/hf_zformer_site .whl/*.whl > "$out/wheels.log" 2>&1 \
        && export PYTHONPATH=/tmp/hf_zformer_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

budget=${BUDGET:-460}
[ "${QUICK:-0}" = 1 ] && budget=${BUDGET:-0}  # a dry run runs every step to its end unless told otherwise
left() {  # seconds a step may still take; kept back: up to 10 s for a stopped step to write, then the archive
    echo $((budget - SECONDS - 20))
}
spent() {  # whether too little of the budget is left to start a step
    [ "$budget" -gt 0 ] && [ "$(left)" -lt 20 ]
}
step() {  # step NAME SECONDS COMMAND...: run and log it within the budget, record its exit status and time, archive
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    if spent; then
        printf '%-14s not run: the budget (BUDGET=%ss) is spent\n' "$name" "$budget" | tee -a "$summary"
        return
    fi
    [ "$budget" -gt 0 ] && [ "$(left)" -lt "$limit" ] && limit=$(left)
    # SIGTERM at the limit: the benchmarks and pytest then write what they measured; killed 10 s later
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    local status=$?
    printf '%-14s rc=%-3s %4ss\n' "$name" "$status" "$((SECONDS - start))" | tee -a "$summary"
    pack
}
pack() {
    # acceptance.md: what has run so far against the bars (scripts/gpu_report.py; JSON only, a second)
    "$python" scripts/gpu_report.py "$out" > /dev/null 2> "$out/report.log"
    # the archive holds every result but not the training steps' checkpoints (train/), so it stays a
    # few hundred KiB: the one file to fetch where a machine hands back only a few small files
    tar -czf "$archive" --exclude "$(basename "$out")/train" -C "$(dirname "$out")" "$(basename "$out")"
}

device=cuda
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || device=cpu
[ "$device" = cpu ] && export TRITON_INTERPRET=1  # the kernels through triton's interpreter
step environment 60 "$python" -c "
import torch, transformers, hf_zformer, benchmarks as b
print(b.machine_info(torch.device('$device')))
print('transformers', transformers.__version__, 'hf_zformer', hf_zformer.__version__)
from hf_zformer.modeling import triton_ops; print('triton kernels', triton_ops.AVAILABLE)
try:
    import fla; print('fla', fla.__version__)
except ImportError as error: print('fla missing:', error)
"
[ "$device" = cuda ] && nvidia-smi >> "$out/environment.log" 2>&1

if [ "${QUICK:-0}" = 1 ]; then
    lengths="64 128"; profiled="64"; compiled_lengths="64"; long="256"; batch=2; width=64; wide="96"; repeats=1; decode=32; marks="16,32"; prefixes="64"
    resources="--widths 16 --dtypes bf16"  # one toy part: every kernel family, compiled in seconds
    matmul="--matmul_size 512"  # the machine's matmul rate from a small product (a CPU's bf16 product of 4,096 takes long)
else
    lengths="128 256 512 1024 2048"; profiled="512 2048"; compiled_lengths="512 2048"; long="4096 8192 16384 32768 65536"; batch=40; width=512; wide="768 1024"
    repeats=5; matmul=""; decode=${DECODE:-1024}; marks=${MARKS:-256,512,1024}; prefixes=${PREFIXES:-4096 32768}
    resources="--widths 64 128"  # the grids' head widths (512 and 1,024 wide), bf16 and fp32
fi
bench="$python scripts/benchmark_attention.py --device $device --modes forward train --no_plot --no_progress --no_memory --repeats $repeats $matmul"
types="full zformer zformer_kernels zformer_torch fastformer fastformer_kernels fastformer_torch"
# the default forms (kernels on CUDA under autocast; folded in fp32), and the folded forms under
# autocast too (the default on CPUs; on CUDA where these grids show them faster)
forms="full zformer fastformer zformer_folded fastformer_folded"
# CUDA graphs time the GPU's own work (no host overhead): a CUDA device only
graphs=""; [ "$device" = cuda ] && graphs="--cuda_graphs"

# the acceptance grid first: forward and training, bf16, every form, CUDA-graph replays
step grid_graphs 240 $bench $graphs --dtype bf16 --batch $batch --widths $width --lengths $lengths \
    --types $forms --output "$out/attention_grid_bf16_graphs"
# the same grid with whole modules (output projection included, as a model's layer calls them):
# the folded forms merge W_o into their own products, and fastformer's pooled output W_r's bias
# into W_o's, only there
step grid_module 240 $bench $graphs --level module --dtype bf16 --batch $batch --widths $width --lengths $lengths \
    --types $forms --output "$out/module_grid_bf16_graphs"
step kernel_tests 120 "$python" -m pytest -q -p no:cacheprovider \
    -k "not fla and not compiled_modules ${KERNEL_TESTS:+and ($KERNEL_TESTS)}" tests/test_kernels.py \
    tests/test_decoding.py "tests/test_benchmark.py::test_cuda_graph_replays_time_every_type"
step device_tests 120 env HF_ZFORMER_TEST_DEVICE=$device "$python" -m pytest -q -p no:cacheprovider -x ${DEVICE_TESTS:+-k "$DEVICE_TESTS"} tests/test_device.py
# decoding: one CUDA-graph replay per token against the full decoder's eager steps
step decoding 150 "$python" scripts/benchmark_generation.py --device $device $graphs --dtype bf16 \
    --max_length $decode --checkpoints $marks --batch_size 8 --output "$out/decoding"
# ms/token after long contexts: every decoder reads a decoder prefix in one forward first (generating
# it step by step with the eager full decoder costs minutes), then 64 tokens are timed
for prefix in $prefixes; do
    step "decoding_$prefix" 90 "$python" scripts/benchmark_generation.py --device $device $graphs --dtype bf16 \
        --prefill $prefix --max_length 64 --checkpoints 32,64 --batch_size 8 --output "$out/decoding_prefill_$prefix"
done
# fastformer's shipped form against the form without each remedy and other pooling slices
# (docs/bench/ab/fastformer_gpu.py: outputs checked first, then CUDA-graph replays side by side)
ab_args="--batch $batch --width $width --lengths $profiled --rounds $((repeats * 4))"
step ab_fastformer 150 "$python" docs/bench/ab/fastformer_gpu.py $ab_args --output "$out/ab_fastformer.json"
# where each whole module's GPU time goes (torch.profiler, self CUDA time per operation and kernel),
# at a short and a long length of the grid, eager calls
step profile 120 $bench --level module --dtype bf16 --batch $batch --widths $width --lengths $profiled --types $forms \
    --profile --output "$out/profile_bf16"
step grid_bf16 120 $bench --dtype bf16 --batch $batch --widths $width --lengths $lengths --types $types \
    --output "$out/attention_grid_bf16"
step grid_fp32 90 $bench $graphs --dtype fp32 --batch $batch --widths $width --lengths $lengths \
    --types full zformer fastformer --output "$out/attention_grid_fp32_graphs"
step grid_wide 100 $bench $graphs --dtype bf16 --batch $batch --widths $wide --lengths $lengths \
    --types $forms --output "$out/attention_grid_wide_bf16_graphs"
step long_bf16 120 $bench $graphs --dtype bf16 --batch 4 --widths $width --lengths $long \
    --types $forms --output "$out/attention_long_bf16_graphs"
step ops 90 "$python" scripts/benchmark_kernels.py --device $device --batch $batch --width $width \
    --lengths $lengths --repeats $repeats --output "$out/ops" --operations bidirectional pooling causal_pooling
# the training scripts' throughput (bf16 on the GPU) against full attention: where the data travelled
# with the checkout into gpu_data/ and `datasets` / `evaluate` import (scripts/gpu_prepare.sh; with
# the budget spent each says it was not run, without the imports)
if [ -d gpu_data/imdb ] && [ -d gpu_data/multi30k ] && { spent || "$python" -c "import datasets, evaluate" 2> /dev/null; }; then
    precision=bf16; [ "$device" = cpu ] && precision=no
    if [ "${QUICK:-0}" = 1 ]; then
        train="--max_train_steps 2 --max_train_samples 64 --max_eval_samples 8"; cls_length=64; batch_size=8; mt_batch=8
    else
        train="--max_train_steps ${TRAIN_STEPS:-300} --max_train_samples 12800 --max_eval_samples 64"
        cls_length=512; batch_size=32; mt_batch=128
    fi
    for kind in full zformer fastformer; do
        step "train_cls_$kind" 90 env ACCELERATE_MIXED_PRECISION=$precision "$python" scripts/run_classification.py \
            --data_dir gpu_data/imdb --attention_type $kind --max_length $cls_length $train \
            --per_device_train_batch_size $batch_size --skip_test --output_dir "$out/train/cls_$kind" \
            --results_file "$out/training_records.json"
        step "train_mt_$kind" 90 env ACCELERATE_MIXED_PRECISION=$precision "$python" scripts/run_translation.py \
            --data_dir gpu_data/multi30k --attention_type $kind --decoder_attention_type $kind $train \
            --per_device_train_batch_size $mt_batch --num_beams 1 --eval_num_beams 1 \
            --output_dir "$out/train/mt_$kind" --results_file "$out/training_records.json"
    done
else
    echo "training steps skipped: no gpu_data/ (scripts/gpu_prepare.sh) or no datasets/evaluate" | tee -a "$summary"
fi
if [ "${FLA:-0}" = 1 ]; then
    step fla 240 "$python" scripts/benchmark_kernels.py --device $device --batch $batch --width $width \
        --lengths $lengths --repeats $repeats --output "$out/ops_causal" --operations causal
    step fla_tests 150 "$python" -m pytest -q -p no:cacheprovider -k fla tests/test_kernels.py
fi
# compiled modules (aot_eager, inductor, inductor's CUDA graphs) calling the kernels' operators: each
# compiles for seconds, so a step of its own
step compile_tests 300 "$python" -m pytest -q -p no:cacheprovider -k compiled_modules tests/test_kernels.py
# what a compiled training step gets: the modules under torch.compile(mode="reduce-overhead"), the
# kernels as operators inside inductor's CUDA graphs (each case compiles for tens of seconds)
step grid_compiled 300 $bench --compile reduce-overhead --dtype bf16 --batch $batch --widths $width \
    --lengths $compiled_lengths --modes train --types full zformer fastformer --output "$out/attention_grid_bf16_compiled"
# what each kernel asks of this GPU as this machine's triton compiles it (registers, spills, shared memory)
arch=90; spent || arch=$("$python" -c "import torch; m, n = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0); print(10 * m + n)")
# (one process per precision and width: a cold triton cache compiles them side by side)
step kernel_resources 90 "$python" scripts/compile_kernels.py --arch "$arch" $resources --json "$out/kernel_resources.json"
pack
echo "wrote $out/ and $archive"
