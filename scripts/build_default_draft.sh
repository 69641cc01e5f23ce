#!/usr/bin/env bash
# Rebuilds the draft shipped for the default model (SmolLM2-135M-Instruct) from scratch:
#   regenerate -> train (four stages) -> bench -> model card -> copy into the package.
# Every step resumes where it stopped, so the work can be spread over several sittings: rerun the script.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_default_draft.sh
#
# The recipe (on a 2-core CPU): block 16 from the target's last layer, then fine-tuning to block 8, where gamma
# weighs the near slots (the ones a one-layer draft gets right) more; both on the target's answers to the first
# 3104 training prompts. Then two stages on all 18,380 answers of data/smollm2-135m-instruct (answers to every
# training prompt, to prompts the target wrote itself, and sampled ones; `scripts/build_training_data.sh` rebuilds
# them) under a time budget, each a new run from the last one's fp32 checkpoint. The shipped draft's first stage
# ran 4800 steps under a schedule that a resume changed (the model card records it); stage 1 here is one clean
# cosine epoch. Caching the target's features (`dflash features`, then `--features DIR`) saves the target forward
# in every epoch after the first.
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
ALL=(data/"$MODEL"/first data/"$MODEL"/rest data/"$MODEL"/self-answers data/"$MODEL"/sampled-1)
mkdir -p "$WORK"
last() { echo "$1/$(cat "$1/latest")"; }    # a run's last checkpoint (fp32 weights, optimizer state)

# 1. the target's own answers to the training prompts only (chat prompts, GSM8K train, MBPP train 601-974)
dflash regenerate chat gsm8k:train mbpp:train -o "$WORK/data" --model "$MODEL" --limit "$ANSWERS" \
    --batch-size 32 --max-new-tokens 512 --threads "$THREADS"

# 2. the draft (rerunning resumes from the latest checkpoint): its first layer starts as a copy of the
#    target's last one, and it proposes from the 8192 most frequent answer tokens (the loss runs over those)
train() {
    dflash train --target "$MODEL" --max-length 1536 --save-interval 100 --save-dtype bfloat16 \
        --threads "$THREADS" --resume "$@"
}
first() { train --data "$WORK/data" --draft-vocab-size 8192 --num-anchors 128 --eval-interval 500 --eval-samples 16 "$@"; }
STAGE1="$WORK/train"
first --output "$STAGE1" --init-from-target --num-layers "$LAYERS" --num-target-features "$FEATURES" \
    --block-size 16 --lr 1e-3 --epochs 1
first --output "$WORK/train-b$BLOCK" --init-draft "$(last "$STAGE1")" --block-size "$BLOCK" --lr 6e-4 --epochs 1
train --data "${ALL[@]}" --output "$WORK/all" --init-draft "$(last "$WORK/train-b$BLOCK")" --block-size "$BLOCK" \
    --num-anchors 512 --lr 3e-4 --warmup 0.02 --epochs 1 --max-hours 1.75 --eval-interval 1000
train --data "${ALL[@]}" --output "$WORK/all-2" --init-draft "$(last "$WORK/all")" --block-size "$BLOCK" \
    --num-anchors 512 --lr 2e-4 --warmup 0.02 --epochs 1 --max-hours 1.15 --seed 1 --eval-interval 400
FINAL="$WORK/all-2/final"

# 3. held-out tau and per-slot acceptance (40 prompts x 128 tokens of each test set), and the speed-up, measured
#    side by side with plain decoding
dflash evaluate --draft "$FINAL" --block-size "$BLOCK" --topk "" --threads "$THREADS" --out "$WORK/evaluate"
mkdir -p "$WORK/bench"
dflash bench --model "$MODEL" --draft "$FINAL" --methods ar,dflash,dflash-adaptive --num-prompts 20 --max-new-tokens 256 \
    --threads "$THREADS" --out "$WORK/bench" | tee "$WORK/bench/table.txt"

# 4. ship it: weights, config, and a model card generated from the runs' own records
mkdir -p "$SHIP"
cp "$FINAL/model.safetensors" "$FINAL/config.json" "$SHIP/"
CARD_DATA=(); for d in "${ALL[@]}"; do CARD_DATA+=(--data "$d"); done
python scripts/model_card.py --train "$STAGE1" --train "$WORK/train-b$BLOCK" --train "$WORK/all" --train "$WORK/all-2" \
    "${CARD_DATA[@]}" --bench "$WORK/bench" --evaluate "$WORK/evaluate" --out "$SHIP/README.md"
