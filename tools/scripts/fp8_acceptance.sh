#!/usr/bin/env bash
# Does a drafter trained on FP8-compute hidden states accept as well as one trained on bf16 ones?
# On the tiny target: one dataset of the target's own greedy text, split into training and held-out
# samples; for --compute dense and --compute fp8 (both bf16 activations) a training cache and a
# held-out cache, one drafter trained on each training cache with the same settings and seed; each
# drafter evaluated on both held-out caches (the decoding walk, greedy chain); then a table of the four
# acceptance lengths (1.0 = no draft token accepted).
# Usage: bash tools/scripts/fp8_acceptance.sh [WORK_DIR]   (default fp8-acceptance; JSON in WORK_DIR/eval-*.json)
# DEVICE=cpu|cuda|auto (default auto) goes to every dflash-extract / dflash-train command (the data are
# generated on CPU); FP8 compute on CUDA needs an sm_89+ GPU. EPOCHS (default 40) sets training length.
# WORK_DIR is deleted only if an earlier run of these scripts made it (tools/scripts/work_dir.sh); else refused.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${1:-fp8-acceptance}"
device="${DEVICE:-auto}"
. tools/scripts/work_dir.sh
fresh_work_dir "$work"
trap 'record_work_dir "$work"' EXIT
step() { printf '\n$ %s\n' "$*"; "$@"; }

step python -m tools.fixtures.tiny_target "$work/target" --seed 0 --mixer-scale 0.1
step python -m tools.fixtures.demo_data --target "$work/target" --out "$work/data.jsonl" --num-samples 160 --new-tokens 32
# 140 samples (~6 shards of 1024 tokens) to train on, 20 (one shard) held out: separate caches, so
# training needs no held-out shards of its own (its decoding walks would cost more than training on CPU).
head -n 140 "$work/data.jsonl" >"$work/train.jsonl"
tail -n 20 "$work/data.jsonl" >"$work/heldout.jsonl"
extract() {
    step dflash-extract --target "$work/target" --data "$work/$1.jsonl" --out "$work/$1-$2" --token-budget 1024 \
        --max-seqs 32 --mask-token-id 511 --dtype bfloat16 --compute "$2" --progress-interval 5 \
        --device "$device" --allow-slow-kernels
}
for compute in dense fp8; do
    extract train "$compute"
    extract heldout "$compute"
    step dflash-train train --cache "$work/train-$compute" --out "$work/run-$compute" --epochs "${EPOCHS:-40}" \
        --lr 3e-3 --log-every 50 --seed 0 --device "$device" --fp8 off  # bf16 training: the caches differ, not it
    step dflash-train export "$work/run-$compute" "$work/drafter-$compute"
done
for drafter in dense fp8; do
    for cache in dense fp8; do
        printf '\n== drafter trained on %s-compute states, evaluated on the %s-compute held-out cache ==\n' \
            "$drafter" "$cache"
        step dflash-train eval --drafter "$work/drafter-$drafter" --cache "$work/heldout-$cache" --holdout-frac 1 \
            --budgets "" --device "$device" --out "$work/eval-$drafter-on-$cache.json"
    done
done
python - "$work" <<'PY'
import json
import sys
from pathlib import Path

work = Path(sys.argv[1])
print("\nacceptance length on the held-out samples (decoding walk, greedy chain; 1.0 = nothing accepted)")
print(f"{'drafter trained on':<22} {'dense-compute cache':>20} {'fp8-compute cache':>18}")
for drafter in ("dense", "fp8"):
    cells = [json.loads((work / f"eval-{drafter}-on-{c}.json").read_text())["acceptance_length"] for c in ("dense", "fp8")]
    print(f"{drafter + '-compute states':<22} {cells[0]:>20.3f} {cells[1]:>18.3f}")
PY
