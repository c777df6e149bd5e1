#!/usr/bin/env bash
# Issue 33 in one device lease (about 10 minutes of an H100): the checks in order of value, each under
# its own timeout so that a hang in one still leaves the others' logs. Run from the repo root on the GPU
# machine, with .whl/ filled here by benchmarks/gpu_wheels.sh (+ peft, + .whl/alt/datasets 4.4.2 for an
# image whose pyarrow is older than datasets 5.2 needs). Everything lands in $OUT (at most 8 files).
#
#   bash benchmarks/gpu_session.sh [TOTAL_S] [TESTS_S] [RECIPES_S]   # default 560, 120, 90 seconds: the peers
#                                                                     # get what the tests leave, less RECIPES_S
#
# Session 12 ran it on an H100 in 186 s (tests 68 s); the bench then needed the editable install above.
# Session 14 ran the peers and the DPO recipe (benchmarks/README.md); this is the next lease's plan (session 29):
# the kernels decision (issue 48) from 3 interleaved rounds of 4 tools, then the long-context recipe's peak with
# what time is left. gpu.py writes its JSON after every run. The 8B model is built on the machine (~16 GB).
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
TOTAL_S=${1:-560}
TESTS_S=${2:-90}
RECIPES_S=${3:-240}
T0=$(date +%s)
left() { echo $((T0 + TOTAL_S - $(date +%s) - ${1:-0})); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    arrow=$(python3 -c "import pyarrow; print(pyarrow.__version__.split('.')[0])")
    if [ "$arrow" -lt 24 ]; then # datasets 5.2 needs pyarrow >= 24
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/alt/*.whl
    fi
    PYTHONPATH=/tmp/site python3 - <<'EOF'
import importlib.metadata as md
for p in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "pyarrow", "trl", "liger-kernel", "triton"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, None)
EOF
} >"$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site
# an editable install: the recipes are package data (finetune.recipes), not importable from the tree alone
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/env.txt" 2>&1

# 1. every test marked gpu; -rA names what ran, skipped or failed
# -o addopts="": one process (the tests share the one GPU), and no -n for an image without pytest-xdist
timeout -k 10 "$TESTS_S" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -rA -q tests >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?" >>"$OUT/gpu_tests.log"

# 3. the 8B job, issue 48's decision and auto's: finetune as shipped (auto: the model's own modules), the fused nodes
# on Triton's kernels, liger's kernels, and TRL + Liger + packing, 3 interleaved rounds (single runs differed by ~15%:
# gpu.py keeps medians, each run and the spread) at 160 examples (~10 steps, 7 timed); then, with what time is
# left, the fused nodes without Triton (FINETUNE_TRITON=0) against them
timeout -k 10 "$(left "$RECIPES_S")" python3 benchmarks/gpu.py --suite peers --models llama-3.1-8b --examples 160 \
    --tools finetune finetune_kernels finetune_liger trl_liger_packing --repeats 3 --timeout 120 \
    --json "$OUT/peers.json" >>"$OUT/bench.log" 2>&1
echo "gpu.py peers exit $?" >>"$OUT/bench.log"
timeout -k 10 "$(left "$RECIPES_S")" python3 benchmarks/gpu.py --suite peers --models llama-3.1-8b --examples 160 \
    --tools finetune_kernels finetune_kernels_eager --repeats 3 --timeout 120 --baseline finetune_kernels \
    --json "$OUT/peers_triton.json" >>"$OUT/bench.log" 2>&1
echo "gpu.py peers (triton) exit $?" >>"$OUT/bench.log"
# 2. the long-context recipe's peak vs its plan (session 14: 2 steps of 131,072 tokens took over 165 s)
timeout -k 10 "$(left 15)" python3 benchmarks/gpu.py --suite recipes --models llama-3.1-8b --examples 160 \
    --recipes qlora-longctx-1x24gb --timeout 400 --json "$OUT/recipes.json" >>"$OUT/bench.log" 2>&1
echo "gpu.py recipes exit $?" >>"$OUT/bench.log"
# the workers' own logs (the last lines of each)
for log in /tmp/finetune-bench/gpu/runs/*/*/log.txt /tmp/finetune-bench/gpu/recipes/*/*/log.txt; do
    [ -f "$log" ] && { echo "== $log"; tail -n 25 "$log"; }
done >"$OUT/workers.log" 2>&1
nvidia-smi >>"$OUT/env.txt" 2>&1
