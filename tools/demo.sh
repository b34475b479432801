#!/usr/bin/env bash
# The whole pipeline on the built-in tiny target, on CPU, in a few minutes:
#   install -> tiny target -> its own greedy text -> extract -> verify -> train -> export -> eval.
# Every step is the real CLI, printed before it runs. Usage: bash tools/demo.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-demo}"

# Commands in bold on a terminal; no escape codes when the output goes to a file.
if [ -t 1 ]; then bold=$'\033[1m' plain=$'\033[0m'; else bold='' plain=''; fi
step() { printf '\n%s$ %s%s\n' "$bold" "$*" "$plain"; "$@"; }

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
# Where no GPU exists, the CPU build of torch first: an unpinned torch would pull a CUDA build.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e '.[plot]'  # matplotlib, for dflash-train plot
rm -rf "$work"
mkdir -p "$work"

# A random-weight Qwen3.5-style target (8 layers, 3:1 GatedDeltaNet/attention, GVA ratio 3). Its
# token mixers are scaled down so that its greedy text has structure a tiny drafter can learn quickly.
step python -m tools.tiny_target "$work/target" --seed 0 --mixer-scale 0.1
# Training data for a drafter is its target's own output: greedy continuations of random prompts.
step python -m tools.demo_data --target "$work/target" --out "$work/data.jsonl" --num-samples 256 --new-tokens 48
step dflash-extract --target "$work/target" --data "$work/data.jsonl" --out "$work/cache" \
    --token-budget 1024 --max-seqs 32 --mask-token-id 511 --dtype float32 --progress-interval 2
step dflash-shards info "$work/cache"
step dflash-shards verify "$work/cache"
# The last 3 shards are held out: evaluated before and after training, never trained on.
step dflash-train train --cache "$work/cache" --out "$work/run" --eval-shards 3 --epochs 24 --lr 3e-3 --log-every 50
# A picture of the run: loss terms, learning rate, tokens/s and held-out acceptance against steps.
step dflash-train plot "$work/run"
step dflash-train export "$work/run" "$work/drafter"
step dflash-train eval --drafter "$work/drafter" --cache "$work/cache" --eval-shards 3
printf '\nDone. The drafter is in %s (DFlashDraftModel layout); the run log is %s/metrics.jsonl,\nits plot %s/run.png (open it with any image viewer, e.g. xdg-open %s/run.png).\n' \
    "$work/drafter" "$work/run" "$work/run" "$work/run"
