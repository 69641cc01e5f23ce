#!/usr/bin/env bash
# Rebuilds the draft shipped for the default model (SmolLM2-135M-Instruct) from scratch:
#   regenerate -> train -> bench -> model card -> copy into the package.
# Every step resumes where it stopped, so the work can be spread over several sittings: rerun the script.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_default_draft.sh
#
# The recipe as it was run (on this 2-core CPU, bf16 target): block 16 for one epoch (76 min, held-out tau 1.43),
# 1712 more steps of a two-epoch schedule (tau still 1.43), then one epoch of fine-tuning to block 8, where
# gamma weighs the near slots (the ones a one-layer draft gets right) more. Caching the target's features
# (`dflash features`, then `--features DIR`) saves the target forward in every epoch after the first.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding chat/, gsm8k/, mbpp/}"
WORK="${WORK:-runs/default-draft}"          # data, training runs and bench output (not committed)
MODEL="smollm2-135m-instruct"
THREADS="${THREADS:-2}"
ANSWERS="${ANSWERS:-3104}"                   # first N prompts of the fixed (seeded) order
LAYERS="${LAYERS:-1}"                        # draft depth
BLOCK="${BLOCK:-8}"                          # block size of the shipped draft (stage 1 trains with 16)
FEATURES="${FEATURES:-3}"                    # target layers tapped
SHIP="src/dflash/drafts/$MODEL"
mkdir -p "$WORK"

# 1. the target's own answers to the training prompts only (chat prompts, GSM8K train, MBPP train 601-974)
dflash regenerate chat gsm8k:train mbpp:train -o "$WORK/data" --model "$MODEL" --limit "$ANSWERS" \
    --batch-size 32 --max-new-tokens 512 --threads "$THREADS"

# 2. the draft (rerunning resumes from the latest checkpoint): its first layer starts as a copy of the
#    target's last one, and it proposes from the 8192 most frequent answer tokens (the loss runs over those)
train() {
    dflash train --target "$MODEL" --data "$WORK/data" --draft-vocab-size 8192 --num-anchors 128 --max-length 1536 \
        --save-interval 200 --eval-interval 500 --eval-samples 16 --save-dtype bfloat16 --threads "$THREADS" --resume "$@"
}
STAGE1="$WORK/train"
train --output "$STAGE1" --init-from-target --num-layers "$LAYERS" --num-target-features "$FEATURES" \
    --block-size 16 --lr 1e-3 --epochs 1
train --output "$STAGE1" --init-from-target --num-layers "$LAYERS" --num-target-features "$FEATURES" \
    --block-size 16 --lr 1e-3 --epochs 2 --max-steps 4800
train --output "$WORK/train-b$BLOCK" --init-draft "$STAGE1/checkpoint-0004800" --block-size "$BLOCK" --lr 6e-4 --epochs 1
FINAL="$WORK/train-b$BLOCK/final"

# 3. the speed-up, measured side by side with plain decoding
mkdir -p "$WORK/bench"
dflash bench --model "$MODEL" --draft "$FINAL" --methods ar,dflash,dflash-adaptive --num-prompts 20 --max-new-tokens 256 \
    --threads "$THREADS" --out "$WORK/bench" | tee "$WORK/bench/table.txt"

# 4. ship it: weights, config, and a model card generated from the run's own records
mkdir -p "$SHIP"
cp "$FINAL/model.safetensors" "$FINAL/config.json" "$SHIP/"
python scripts/model_card.py --train "$STAGE1:4800" --train "$WORK/train-b$BLOCK" --data "$WORK/data" --bench "$WORK/bench" --out "$SHIP/README.md"
