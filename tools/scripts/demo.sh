#!/usr/bin/env bash
# The whole pipeline on the built-in tiny target, on CPU, in a few minutes:
#   install -> tiny target -> chats -> the target's own replies (regenerate, over HTTP) -> prepare
#   (chat template + loss mask) -> extract -> verify -> train -> export -> eval.
# Every step is the real CLI, printed before it runs. Usage: bash tools/scripts/demo.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${1:-demo}"
. tools/scripts/work_dir.sh
fresh_work_dir "$work"  # before the install: a WORK_DIR in the way is refused at once
trap 'record_work_dir "$work"' EXIT

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
python -m pip install -q -e '.[plot,data]'  # matplotlib for dflash-train plot; tokenizer + client for dflash-data

# A random-weight Qwen3.5-style target (8 layers, 3:1 GatedDeltaNet/attention, GVA ratio 3). Its
# token mixers are scaled down so that its greedy text has structure a tiny drafter can learn quickly.
step python -m tools.fixtures.tiny_target "$work/target" --seed 0 --mixer-scale 0.1
# Training data for a drafter is its target's own output. Start from chats, let the target answer
# them through an OpenAI-compatible server (here a tiny one; vllm serve / SGLang for a real target),
# then render them with the target's chat template, the loss mask on what the model wrote.
step python -m tools.fixtures.demo_data --conversations --out "$work/chats.jsonl" --num-samples 128
printf '\n%s$ python -m tools.fixtures.tiny_server --target %s --port-file %s --max-batch 64 &%s\n' "$bold" "$work/target" "$work/port" "$plain"
python -m tools.fixtures.tiny_server --target "$work/target" --port-file "$work/port" --max-batch 64 &
server_pid=$!
trap 'kill "$server_pid" 2>/dev/null || true; record_work_dir "$work"' EXIT
for _ in $(seq 120); do [ -s "$work/port" ] && break; sleep 0.5; done
[ -s "$work/port" ] || { echo "the tiny server did not start" >&2; exit 1; }
step dflash-data regenerate --server "http://127.0.0.1:$(cat "$work/port")/v1" --model tiny \
    --data "$work/chats.jsonl" --out "$work/regenerated.jsonl" --thinking off --max-tokens 32 --concurrency 64
kill "$server_pid" 2>/dev/null || true
step dflash-data prepare --target "$work/target" --data "$work/regenerated.jsonl" --out "$work/data.parquet" --thinking off
step dflash-extract --target "$work/target" --data "$work/data.parquet" --out "$work/cache" \
    --token-budget 1024 --max-seqs 32 --mask-token-id 511 --dtype float32 --progress-interval 2 \
    --target-topk 1
step dflash-shards info "$work/cache"
step dflash-shards verify "$work/cache"
# The last 3 shards are held out, never trained on. The run walks all 3 (the decoding walk, greedy chain;
# DDTree budgets only in `dflash-train eval`) before training and at the end (--eval-every past the last step).
# A line every 8 of its 96 steps: 13 points per curve in the plot, each with the monitoring metrics.
step dflash-train train --cache "$work/cache" --out "$work/run" --eval-shards 3 --eval-every 1000000 --epochs 24 --lr 3e-3 --log-every 8
# A picture of the run: loss terms, learning rate, tokens/s and held-out acceptance against steps.
step dflash-train plot "$work/run"
step dflash-train export "$work/run" "$work/drafter"
# The decoding walk on the held-out shards: anchors where greedy speculative decoding puts them.
step dflash-train eval --drafter "$work/drafter" --cache "$work/cache" --eval-shards 3 --out "$work/eval.json"
# Real speculative decoding with the target in the loop (float32: the tiny target's own precision);
# its output must equal plain greedy decoding token for token, and it reports tokens/s of both.
step dflash-train eval --drafter "$work/drafter" --target "$work/target" --prompts "$work/data.parquet" \
    --max-prompts 16 --max-new-tokens 32 --dtype float32
printf '\nDone. The drafter is in %s (DFlashDraftModel layout); the run log is %s/metrics.jsonl,\nits plot %s/run.png (open it with any image viewer, e.g. xdg-open %s/run.png).\n' \
    "$work/drafter" "$work/run" "$work/run" "$work/run"
