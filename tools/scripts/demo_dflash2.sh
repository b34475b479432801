#!/usr/bin/env bash
# DFlash 2 next to DFlash 1 on the built-in tiny target, on CPU, in a few minutes: one cache, two drafters
# trained alike (block 8, as the published Qwen3.8-27B-DFlash2), each exported, walked over the held-out
# shards (DFlash 2 drafts its selector's greedy path) and run with the target in the loop; then both
# acceptance lengths side by side. Every step is the real CLI, printed before it runs.
# Usage: bash tools/scripts/demo_dflash2.sh [WORK_DIR]   (after tools/scripts/demo.sh has installed .venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${1:-demo_dflash2}"
. tools/scripts/work_dir.sh
fresh_work_dir "$work"
trap 'record_work_dir "$work"' EXIT

if [ -t 1 ]; then bold=$'\033[1m' plain=$'\033[0m'; else bold='' plain=''; fi
step() { printf '\n%s$ %s%s\n' "$bold" "$*" "$plain"; "$@"; }
[ -x .venv/bin/python ] || { echo "$0: no .venv: run tools/scripts/demo.sh first (it installs)" >&2; exit 1; }
. .venv/bin/activate

step python -m tools.fixtures.tiny_target "$work/target" --seed 0 --mixer-scale 0.1
# The target's own greedy continuations of random prompts (demo.sh shows the chat route through a server).
step python -m tools.fixtures.demo_data --target "$work/target" --out "$work/data.jsonl" --num-samples 160 --new-tokens 32
step dflash-extract --target "$work/target" --data "$work/data.jsonl" --out "$work/cache" \
    --token-budget 1024 --max-seqs 32 --mask-token-id 511 --dtype float32 --target-topk 1
for arch in dflash dflash2; do
    step dflash-train train --cache "$work/cache" --out "$work/run-$arch" --arch "$arch" --block-size 8 \
        --eval-shards 2 --eval-every 1000000 --epochs 24 --lr 3e-3 --log-every 32
    step dflash-train export "$work/run-$arch" "$work/drafter-$arch"
    step dflash-train eval --drafter "$work/drafter-$arch" --cache "$work/cache" --eval-shards 2 \
        --out "$work/eval-$arch.json"
    step dflash-train eval --drafter "$work/drafter-$arch" --target "$work/target" --prompts "$work/data.jsonl" \
        --max-prompts 4 --max-new-tokens 32 --dtype float32 --out "$work/target-$arch.json"
done
python - "$work" <<'PY'
import json, sys
work = sys.argv[1]
print("\nacceptance length (tokens per verify step, mean over responses):")
print(f"{'drafter':<8} {'walk (held-out)':>16} {'target in the loop':>19}")
for arch in ("dflash", "dflash2"):
    walk = json.load(open(f"{work}/eval-{arch}.json"))
    target = json.load(open(f"{work}/target-{arch}.json"))
    decoded = target["speculative_decoding"]
    print(f"{arch:<8} {walk['acceptance_length']:>16.3f} {decoded['acceptance_length']:>19.3f}")
PY
