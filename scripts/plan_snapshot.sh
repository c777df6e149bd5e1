#!/usr/bin/env bash
# scripts/plan_snapshot.sh OUT — every shipped recipe's `finetune plan` output (text, --json, --max-seq,
# --fit with the recipe it writes) on the fixture configs, in one file: run it before and after a
# refactor and `cmp` the two (issue 26: plan output byte-identical). ~20 min on 2 cores (200 commands).
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/plan_snapshot.sh OUT}
configs=tests/fixtures/configs
fit=$(mktemp -d)/fit.yaml
: > "$out"
for recipe in recipes/*.yaml; do
  for model in qwen2.5-7b llama-3.1-8b llama-3-70b qwen3-30b-a3b; do
    for args in "--gpu rtx4090" "--gpu rtx3060 --gpus 2" "--gpu rtx4090 --gpus 4 --json" "--gpu rtx4090 --max-seq" \
                "--gpu rtx4090 --gpus 2 --fit --out $fit --force"; do
      echo "=== $(basename "$recipe" .yaml) $model ${args/$fit/FIT}" >> "$out"
      # shellcheck disable=SC2086
      python -m finetune plan "$recipe" "model.path=$configs/$model" data.path=x.jsonl $args 2>&1 | sed "s|$fit|FIT|g" >> "$out"
      echo "rc=${PIPESTATUS[0]}" >> "$out"
      if [ -f "$fit" ]; then sed "s|$fit|FIT|g" "$fit" >> "$out"; rm "$fit"; fi
    done
  done
done
