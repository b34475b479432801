#!/usr/bin/env bash
# Does a drafter trained on FP8-compute hidden states accept as well as one trained on bf16 ones?
# On the tiny target (CPU; a GPU works too): one dataset of the target's own greedy text, two caches
# (--compute dense and --compute fp8, both bf16 activations), one drafter trained on each with the
# same settings and seed, each evaluated on the held-out shards of both caches.
# Usage: bash tools/fp8_acceptance.sh [WORK_DIR]    (prints the eval lines; JSON under WORK_DIR/eval-*)
# DEVICE=cpu|cuda|auto (default auto) is passed to every dflash-extract / dflash-train command.
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-fp8-acceptance}"
. tools/work_dir.sh
fresh_work_dir "$work"
step() { printf '\n$ %s\n' "$*"; "$@"; }

step python -m tools.tiny_target "$work/target" --seed 0 --mixer-scale 0.1
step python -m tools.demo_data --target "$work/target" --out "$work/data.jsonl" --num-samples 256 --new-tokens 48
for compute in dense fp8; do
    step dflash-extract --target "$work/target" --data "$work/data.jsonl" --out "$work/cache-$compute" \
        --token-budget 1024 --max-seqs 32 --mask-token-id 511 --dtype bfloat16 --compute "$compute" \
        --progress-interval 5 --device "${DEVICE:-auto}"
    step dflash-train train --cache "$work/cache-$compute" --out "$work/run-$compute" --eval-shards 3 \
        --epochs 24 --lr 3e-3 --log-every 200 --seed 0 --device "${DEVICE:-auto}"
    step dflash-train export "$work/run-$compute" "$work/drafter-$compute"
done
for drafter in dense fp8; do
    for cache in dense fp8; do
        printf '\n== drafter trained on %s-compute states, evaluated on the %s-compute cache ==\n' "$drafter" "$cache"
        step dflash-train eval --drafter "$work/drafter-$drafter" --cache "$work/cache-$cache" --eval-shards 3 \
            --device "${DEVICE:-auto}" --out "$work/eval-$drafter-on-$cache.json"
    done
done
