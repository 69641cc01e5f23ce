#!/usr/bin/env bash
# Rebuilds the draft shipped for the default model (SmolLM2-135M-Instruct) from scratch:
#   regenerate -> features -> train -> bench -> model card -> copy into the package.
# Every step resumes where it stopped, so the work can be spread over several sittings: rerun the script.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_default_draft.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding chat/, gsm8k/, mbpp/}"
WORK="${WORK:-runs/default-draft}"          # data, features and training runs (not committed)
MODEL="smollm2-135m-instruct"
THREADS="${THREADS:-2}"
LAYERS="${LAYERS:-1}"                        # draft depth
BLOCK="${BLOCK:-16}"                         # block size (published choice)
FEATURES="${FEATURES:-3}"                    # target layers tapped
MAX_NEW="${MAX_NEW:-512}"
SHIP="src/dflash/drafts/$MODEL"
mkdir -p "$WORK"

# 1. the target's own answers to the training prompts only (chat prompts, GSM8K train, MBPP train 601-974)
dflash regenerate chat gsm8k:train mbpp:train -o "$WORK/data" --model "$MODEL" \
    --batch-size 32 --max-new-tokens "$MAX_NEW" --threads "$THREADS"

# 2. the target's hidden states, once, so that training epochs skip the target forward
dflash features --target "$MODEL" --data "$WORK/data" --features "$WORK/features" \
    --num-layers "$LAYERS" --num-target-features "$FEATURES" --max-length 1536 --threads "$THREADS"

# 3. the draft (rerunning resumes from the latest checkpoint)
dflash train --target "$MODEL" --data "$WORK/data" --features "$WORK/features" --output "$WORK/train" \
    --num-layers "$LAYERS" --num-target-features "$FEATURES" --block-size "$BLOCK" --num-anchors 64 \
    --epochs "${EPOCHS:-3}" --lr 6e-4 --max-length 1536 --save-interval 200 --eval-interval 500 \
    --save-dtype bfloat16 --threads "$THREADS" --resume

# 4. the speed-up, measured side by side with plain decoding
mkdir -p "$WORK/bench"
dflash bench --model "$MODEL" --draft "$WORK/train/final" --num-prompts 20 --max-new-tokens 256 \
    --threads "$THREADS" --out "$WORK/bench" | tee "$WORK/bench/table.txt"

# 5. ship it: weights, config, and a model card generated from the run's own records
mkdir -p "$SHIP"
cp "$WORK/train/final/model.safetensors" "$WORK/train/final/config.json" "$SHIP/"
python scripts/model_card.py --train "$WORK/train" --data "$WORK/data" --bench "$WORK/bench" --out "$SHIP/README.md"
