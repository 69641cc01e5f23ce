#!/usr/bin/env bash
# Trains the EAGLE-3-style peer for the default model on the data of scripts/build_default_draft.sh (run that
# script's step 1 first), then benches it next to DFlash, prompt lookup and plain decoding.
# Rerunning resumes from the latest checkpoint, so the work can be spread over several sittings.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_eagle3_draft.sh
#
# With EPOCHS=1 on this 2-core CPU the training took 71 minutes (3088 steps), about what the DFlash draft's
# first epoch took (75 minutes). It reached a held-out tau of 1.78, against DFlash's 1.43 after that epoch.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding gsm8k/, mbpp/, math500/}"
WORK="${WORK:-runs/default-draft}"
MODEL="smollm2-135m-instruct"
THREADS="${THREADS:-2}"
CHAIN="${CHAIN:-6}"                          # proposals per step (verify width CHAIN+1), unrolled in training

# the same data, draft vocabulary, anchors per sequence and epochs as the DFlash draft: about the same compute
dflash train --method eagle3 --target "$MODEL" --data "$WORK/data" --output "$WORK/eagle3" \
    --block-size "$((CHAIN + 1))" --draft-vocab-size 8192 --num-anchors 128 --epochs "${EPOCHS:-2}" --lr 1e-3 \
    --max-length 1536 --save-interval 200 --eval-interval 1000 --eval-samples 16 --save-dtype bfloat16 \
    --threads "$THREADS" --resume

mkdir -p "$WORK/bench-peers"
dflash bench --model "$MODEL" --draft "$WORK/train/final" --eagle-draft "$WORK/eagle3/final" \
    --methods ar,dflash,eagle3,ngram,hf-prompt-lookup --num-prompts 20 --max-new-tokens 256 \
    --threads "$THREADS" --out "$WORK/bench-peers" | tee "$WORK/bench-peers/table.txt"
