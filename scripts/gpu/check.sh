#!/usr/bin/env bash
# The GPU kit, step 2: on the GPU node (no network needed), after scripts/gpu/prepare.sh made .gpu/ on a
# machine with network and the checkout was copied over with it. One script: it installs .gpu/wheels into
# /tmp/site, points the harness at .gpu/data and .gpu/tokenizer, and runs these stages, each under its own
# time limit (about 8 minutes in all on an H100) so that a stuck one costs only its own share:
#   1. env       device, driver, torch, CUDA, the commit (.gpu/commit.txt)
#   2. probe     only when STAGES names it: scripts/gpu/step_probe.py, a decode step against the
#                same forward alone, at two CPU thread counts, cuDNN's attention on and off
#   3. profile   scripts/profile_device.py on random weights of Vicuna-7B's shape, fp16: the
#                forward cost curve for 1..64 new tokens (eager) and the step against its floor
#   4. big       scripts/gpu/big_target.py: every decoder on that target, two Spec-Bench
#                questions each with check_lossless: ties, time split per step, peak memory
#   5. syncs     scripts/step_overhead.py --untrained on tiny-random (a nearly free forward): each
#                method's own ms per step outside the forwards, and how often a step makes the host
#                wait for the device, by line of code (the goal: one wait per step)
#      sampled   the same at temperature 0.7 for the methods that verify sampled trees and chains:
#                sampled verification's waits (one a step: decoders/core/verify.py, read_at_once)
#   6. pytest    pytest -m "cuda and not slow": every decoder on tiny-random in fp16 and bf16 at
#                batch 1 and 4 with check_lossless, the half-precision slice, training for a step
#                (last: its 115 tests may be cut off by the limit, the big check must not be)
#   7. compiled  with COMPILED=1 only (minutes more): the cost curve again with model.compile=inductor
# STAGES="env probe big" (say) runs only those, in this order; the default is env profile big syncs sampled pytest.
# Writes to $OUT: summary.md (each stage's end), log.txt (everything), gpu_check.tar.gz (all
# files); copy them back into results/reference/gpu/<date>-<device>/.
#
#   on the node:  OUT=DIR bash scripts/gpu/check.sh
#   on a CPU:     OUT=DIR bash scripts/gpu/check.sh --cpu   (tiny shapes, the same stages, seconds: the test)
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0;; esac  # the header above is the manual
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
mode=gpu
[ "${1:-}" = --cpu ] && mode=cpu
out=${OUT:?set OUT to the folder to write into}
mkdir -p "$out"
work=$(mktemp -d)/gpu_check
mkdir -p "$work"
exec > >(tee -a "$out/log.txt") 2>&1

if [ "$mode" = gpu ]; then
  device=cuda; shape=vicuna-7b; xdist=12; tokens=64; repeats=5; limit=2; new=32
  probed=autoregressive,prompt_lookup,spec_chain,lookahead,sequoia
  # pytest, profile, big, compiled, probe, syncs: seconds (on an H100 on 2026-11-26, 115 tests took about
  # 200 s, the profile 35, each decoder on the 7B shape about 15, and the compile more than 90; on an H200
  # the 14 decoders took 204 s, near the old 220; syncs is 15 decoders on a tiny model, 33 s on a CPU)
  limits=(200 60 260 150 150 90 60)
else
  device=cpu; shape=tiny; xdist=0; tokens=64; repeats=1; limit=1; new=4
  probed=autoregressive,lookahead  # the loop over decoders and kernel sets, not what they measure here
  limits=(120 120 300 1 120 120 120)   # compiled is not run on the CPU (test_compile.py covers it)
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error WANDB_MODE=disabled
export BENCH_CACHE_DIR=$work/cache BENCH_COMPILE=none
[ -d .gpu/data ] && export BENCH_DATA_DIR=$repo/.gpu/data
# tiny-random borrows a saved tokenizer: prepare.sh's, or one the caller names (the test suite: its own, read
# once; a stage reading it from the embedded GGUF pays seconds each)
[ -d .gpu/tokenizer ] && export BENCH_TINY_TOKENIZER=$repo/.gpu/tokenizer
tokenizer=()
[ -n "${BENCH_TINY_TOKENIZER:-}" ] && tokenizer=(--tokenizer "$BENCH_TINY_TOKENIZER")
if [ -d .gpu/wheels ] && [ "$mode" = gpu ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl || { echo "check.sh: installing .gpu/wheels failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$repo
else
  export PYTHONPATH=$repo
fi

summary=$work/summary.md
stages=" ${STAGES:-env profile big syncs sampled pytest} "
[ "${COMPILED:-0}" = 1 ] && stages+="compiled "
stage() {  # stage NAME LIMIT COMMAND...: its output in NAME.log, its exit code and time in summary.md
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  [[ $stages == *" $name "* ]] || return 0
  echo "== $name (limit ${limit} s): $*"
  timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  tail -n 25 "$work/$name.log"
  { echo "## $name: exit $rc in $((SECONDS - start)) s (limit $limit s)"
    [ $rc -eq 124 ] && echo "timed out"
    echo; echo '```'; tail -n 25 "$work/$name.log"; echo '```'; echo; } >>"$summary"
}

{ echo "# GPU check ($mode), $(date -u +%FT%TZ)"; echo
  echo "commit: $(cat .gpu/commit.txt 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"; echo; } >"$summary"
stage env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1;
  python3 -c "import torch, transformers, sys; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__,
  \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__, \"device\",
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"none\")"; nproc'
stage probe "${limits[4]}" python3 scripts/gpu/step_probe.py --shape "$shape" --repeats "$((repeats * 4))" \
  --max-new-tokens "$new" --decoders "$probed" \
  "${tokenizer[@]}" device=$device
# big_target.py prints a shape's overrides, one per line: asked only for the stages that read them
# (each ask is a Python start, seconds on a slow CPU)
model=() tiny=()
if [[ $stages =~ " "(profile|compiled)" " ]]; then
  mapfile -t model < <(python3 scripts/gpu/big_target.py --shape "$shape" --print-model "${tokenizer[@]}")
fi
if [[ $stages =~ " "(syncs|sampled)" " ]]; then
  if [ "$shape" = tiny ] && [ ${#model[@]} -gt 0 ]; then
    tiny=("${model[@]}")
  else
    mapfile -t tiny < <(python3 scripts/gpu/big_target.py --shape tiny --print-model "${tokenizer[@]}")
  fi
fi
stage profile "${limits[1]}" python3 scripts/profile_device.py --max-tokens "$tokens" --repeats "$repeats" \
  --paths none --out "$work/profile" "${model[@]}" device=$device
stage big "${limits[2]}" python3 scripts/gpu/big_target.py --out "$work/big" --shape "$shape" --limit "$limit" \
  --max-new-tokens "$new" "${tokenizer[@]}" device=$device
stage syncs "${limits[5]}" python3 scripts/step_overhead.py --untrained --prompts "$limit" --max-new-tokens "$new" \
  --out "$work/syncs" "${tiny[@]}" dataset=spec_bench device=$device
stage sampled "${limits[6]}" python3 scripts/step_overhead.py --untrained --temperature 0.7 --prompts "$limit" \
  --max-new-tokens "$new" --decoders spec_chain,specinfer,sequoia,eagle,medusa,lookahead --out "$work/sampled" \
  "${tiny[@]}" dataset=spec_bench device=$device
stage pytest "${limits[0]}" python3 -m pytest -m "cuda and not slow" -n "$xdist" -p no:cacheprovider -q \
  --junitxml="$work/pytest.xml" tests/test_cuda.py tests/test_half_precision.py tests/test_device_placement.py
if [ "$mode" = gpu ]; then  # past the 8 minutes: COMPILED=1 where time allows
  stage compiled "${limits[3]}" python3 scripts/profile_device.py --max-tokens "$tokens" --repeats "$repeats" \
    --paths none+inductor --out "$work/profile_compiled" "${model[@]}" device=$device
fi

cp "$summary" "$out/summary.md"
# Run directories hold records.jsonl files: the archive keeps them whole, beside the logs.
tar -czf "$out/gpu_check.tar.gz" -C "$(dirname "$work")" --exclude=gpu_check/cache gpu_check
echo "check.sh: $out/summary.md, $out/gpu_check.tar.gz ($(du -h "$out/gpu_check.tar.gz" | cut -f1))"
