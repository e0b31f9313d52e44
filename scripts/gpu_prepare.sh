#!/usr/bin/env bash
# Prepare a checkout for scripts/gpu_check.sh on a GPU machine without network: wheels of the Python
# packages such machines lack (transformers at the version this checkout is tested with, fla-core,
# datasets and evaluate with their small dependencies) into .whl/, and the data of the training
# throughput steps (IMDB train/test, Multi30K) into gpu_data/. Both folders are git-ignored; carry
# them with the checkout (about 50 MB).
#
#     bash scripts/gpu_prepare.sh [DATA_DIR]          # DATA_DIR: a folder holding imdb/ and multi30k/ (default ../shared/data)
#
# PYTHON_VERSION is the GPU machine's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data}
python=${PYTHON:-python3}
version=${PYTHON_VERSION:-3.12}
for folder in imdb multi30k; do
    [ -d "$data/$folder" ] || { echo "gpu_prepare: $data/$folder not found (give the data folder)" >&2; exit 2; }
done
transformers=$("$python" -c "import transformers; print(transformers.__version__)")
mkdir -p .whl
"$python" -m pip download -q --dest .whl --no-deps --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    "transformers==$transformers" fla-core datasets evaluate dill multiprocess xxhash
mkdir -p gpu_data/imdb gpu_data/multi30k
cp "$data"/imdb/train.jsonl.gz "$data"/imdb/test.jsonl.gz gpu_data/imdb/
cp "$data"/multi30k/*.gz gpu_data/multi30k/
du -sh .whl gpu_data
