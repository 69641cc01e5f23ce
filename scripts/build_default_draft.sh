#!/usr/bin/env bash
# Rebuilds the draft shipped for the default model (SmolLM2-135M-Instruct) from scratch:
#   the target's features -> train -> evaluate -> bench -> model card -> copy into the package.
# Every step resumes where it stopped, so the work can be spread over several sittings: rerun the script.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_default_draft.sh
#
# The data: all 21,355 answers of data/smollm2-135m-instruct (the target's own answers to every training prompt,
# to prompts it wrote itself, to MBPP's train tasks posed for completion, to writing, role-play and reasoning tasks
# it wrote from given openings, and sampled ones;
# `scripts/build_training_data.sh` rebuilds them).
# The recipe is the best arm of the comparison in scripts/train_ablation.sh (r15: on the first 3104 answers, 0.65 h
# on one thread, it beat the 8 h recipe this script used before, and the EAGLE-3-style peer at equal hours), three
# layers deep (depth paid in every arm that tried it: r21, r25): block 8 throughout, fresh layers, 8 answers of 32
# anchors a step (the anchors of one answer share most of their context, so more answers a step teach more than
# more anchors of one), as many key/value heads as attention heads, the target's tapped states read from a cache
# made once (the target's forward is most of a live step on a CPU) and the step compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding chat/, gsm8k/, mbpp/}"
WORK="${WORK:-runs/default-draft}"          # features, training run and bench output (not committed)
MODEL="smollm2-135m-instruct"
THREADS="${THREADS:-2}"
LAYERS="${LAYERS:-3}"                        # draft depth
BLOCK="${BLOCK:-8}"                          # block size
FEATURES="${FEATURES:-3}"                    # target layers tapped
EPOCHS="${EPOCHS:-2}"                        # about 2300 steps each
SHIP="src/dflash/drafts/$MODEL"
# FOLDERS picks stage 1's answer folders (the shipped draft: all four, 3 layers, 2 epochs, 1.9 h on 2 threads of an
# AVX-512 Xeon, then the later stages below; the one-layer draft before it, 3 epochs in 1.2 h, reached a lower tau on
# every test set); LATER the folders that joined at a later stage (stage 7: MBPP's train tasks posed as HumanEval
# poses its own, answered greedily and twice sampled; stage 9: the writing, role-play and reasoning tasks)
FOLDERS="${FOLDERS:-first rest self-answers sampled-1}"
LATER="${LATER:-code-complete code-complete-s1 code-complete-s2 task-answers}"
ALL=(); for f in $FOLDERS $LATER; do ALL+=(data/"$MODEL"/"$f"); done
CACHE=(); for d in "${ALL[@]}"; do CACHE+=("$WORK/features/$(basename "$d")"); done
N1=$(wc -w <<< "$FOLDERS")                   # stage 1 trains on the first N1 of ALL
mkdir -p "$WORK"
# what every training stage shares: the draft's shape around the target, its batches, the compiled bf16 step
COMMON=(--target "$MODEL" --num-target-features "$FEATURES" --num-kv-heads 9 --block-size "$BLOCK" --num-anchors 32
    --batch-size 8 --max-length 1536 --compile --autocast auto --save-interval 100 --threads "$THREADS" --resume)

# 1. the target's states at the tapped layers for every answer, in bf16, with its top 32 tokens after every position
#    (7% more disk; what a distillation arm, --distill, reads). A new folder is made by the default runtime (the
#    int4 one: the states the draft sees when it serves, and faster than hf); a folder keeps the runtime it was
#    started with
dflash features --target "$MODEL" --data "${ALL[@]}" --features "${CACHE[@]}" --num-target-features "$FEATURES" \
    --max-length 1536 --distill-topk 32 --feature-dtype bfloat16 --threads "$THREADS"

# 2. the draft (rerunning resumes from the latest checkpoint); it proposes from the 8192 most frequent answer
#    tokens (the loss runs over those). Its products in bf16 where oneDNN packs bf16 (fp32 master weights), as in
#    the ablation arms: steps 20-50 of these flags at 3 layers took 0.90 s each against 1.16 in fp32 on 2 threads of
#    an AVX-512 (AMX) Xeon; fp32 elsewhere
TRAIN="$WORK/train"
dflash train "${COMMON[@]}" --data "${ALL[@]:0:N1}" --features "${CACHE[@]:0:N1}" --output "$TRAIN" \
    --num-layers "$LAYERS" --lr 6e-4 --warmup 0.04 --epochs "$EPOCHS" --draft-vocab-size 8192 --eval-interval 1000 \
    --save-dtype bfloat16

# 2b-2k. later stages: each a new run from the stage before's draft over the named answer folders, a cosine
#     from its own peak over a fixed step count (the counts the shipped runs took, so a rebuild on any machine has
#     their schedule). Stage 2 is arm l3 of stop 63: the greedy answers once more at half the learning rate, 1376
#     steps in 0.81 h on one thread of an AMD EPYC with AVX-512, beside arm l4, the same grown to 4 layers, which
#     reached the same tau; held-out mean tau 1.97 -> 2.03 (`dflash evaluate`, 40 x 128, block 8, that machine).
#     Stage 3 is arm stage3-b of stop 64: all four folders at stage 2's learning rate, 2890 steps in 1.55 h on one
#     thread of that EPYC, beside arm stage3-a at half that rate (2.09); mean tau 2.03 -> 2.10. Stage 4 is the same
#     once more from stage 3 (another seed), 2890 steps of about 1.8 s on one thread beside the peer's training (1.45 h
#     of steps; its log counts 1.92 h, with a pause for tests): mean tau 2.10 -> 2.19. Stage 5, once more from stage
#     4 (another seed, about 2 s a step on one thread beside the peer's training): mean tau 2.19 -> 2.24. Stage 6,
#     once more from stage 5 (another seed; 2050 steps on one thread, 840 on two at 1.3 s): mean tau 2.24 -> 2.30.
#     Stage 7, once more from stage 6 over all seven folders, the code-complete ones joining (another seed; 2890 steps
#     of about 1.1 s on two threads, 0.93 h): mean tau 2.30 -> 2.38, MBPP +0.14 and HumanEval +0.14. Stage 8, once
#     more from stage 7 (another seed; 2890 steps of about 1.75 s on one thread, beside an arm at gamma 5 that reached
#     the same mean tau): mean tau 2.38 -> 2.42. Stage 9, once more from stage 8 over all eight folders, the
#     task-answers joining (another seed; 2890 steps of about 2 s on one thread, beside an arm without them that
#     reached 2.46): mean tau 2.42 -> 2.47, HumanEval +0.06 and MT-Bench +0.03 over that arm. Stage 10, two runs
#     from stage 9 side by side over all eight folders, one thread each (a: the recipe once more, 2890 steps of about
#     2 s; b: 64 anchors of 4 answers a step, about 1.65 s), then the mean of their weights (`dflash average`):
#     mean tau 2.47 -> 2.49 (a), 2.48 (b), 2.52 (their average; +0.026 [+0.008, +0.043] over a). Stage 11, the
#     same two runs once more from stage 10's average (seeds 13 and 14), then their average: mean tau 2.52 -> 2.52
#     (a), 2.51 (b), 2.55 (their average; +0.034 [+0.012, +0.055] over stage 10's).
#     Stages 2 and 7 start from the stage before's bf16 export; stages 2 to 5 and 7 to 10 save fp32 for the next, as
#     the shipped runs did
STAGE_FOLDERS=(first rest self-answers sampled-1 code-complete code-complete-s1 code-complete-s2 task-answers)
stage() {  # output, draft to start from, peak lr, schedule steps, seed, save dtype, answer folders... [-- flags]
    local out=$1 init=$2 lr=$3 steps=$4 seed=$5 dtype=$6; shift 6
    local data=() cache=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do data+=(data/"$MODEL"/"$1"); cache+=("$WORK/features/$1"); shift; done
    [ $# -gt 0 ] && shift  # what follows -- overrides COMMON (the last of a repeated flag counts)
    dflash train "${COMMON[@]}" --data "${data[@]}" --features "${cache[@]}" --output "$out" --init-draft "$init" \
        --lr "$lr" --warmup 0.02 --epochs 2 --schedule-steps "$steps" --eval-interval 500 --save-dtype "$dtype" \
        --seed "$seed" "$@"
}
STAGE2="$WORK/stage2"
STAGE3="$WORK/stage3"
STAGE4="$WORK/stage4"
STAGE5="$WORK/stage5"
STAGE6="$WORK/stage6"
STAGE7="$WORK/stage7"
STAGE8="$WORK/stage8"
STAGE9="$WORK/stage9"
STAGE10="$WORK/stage10"                      # the average of the two runs below
STAGE11="$WORK/stage11"                      # likewise
stage "$STAGE2" "$TRAIN/final" 3e-4 1376 1 float32 first rest self-answers
stage "$STAGE3" "$STAGE2/final" 3e-4 2890 2 float32 first rest self-answers sampled-1
stage "$STAGE4" "$STAGE3/final" 3e-4 2890 3 float32 first rest self-answers sampled-1
stage "$STAGE5" "$STAGE4/final" 3e-4 2890 4 float32 first rest self-answers sampled-1
stage "$STAGE6" "$STAGE5/final" 3e-4 2890 5 bfloat16 first rest self-answers sampled-1
stage "$STAGE7" "$STAGE6/final" 3e-4 2890 7 float32 first rest self-answers sampled-1 \
    code-complete code-complete-s1 code-complete-s2
stage "$STAGE8" "$STAGE7/final" 3e-4 2890 8 float32 first rest self-answers sampled-1 \
    code-complete code-complete-s1 code-complete-s2
stage "$STAGE9" "$STAGE8/final" 3e-4 2890 9 float32 "${STAGE_FOLDERS[@]}"
stage "$STAGE10-a" "$STAGE9/final" 3e-4 2890 11 float32 "${STAGE_FOLDERS[@]}"
stage "$STAGE10-b" "$STAGE9/final" 3e-4 2890 12 float32 "${STAGE_FOLDERS[@]}" -- --num-anchors 64 --batch-size 4
dflash average "$STAGE10-a/final" "$STAGE10-b/final" -o "$STAGE10"
stage "$STAGE11-a" "$STAGE10" 3e-4 2890 13 float32 "${STAGE_FOLDERS[@]}"
stage "$STAGE11-b" "$STAGE10" 3e-4 2890 14 float32 "${STAGE_FOLDERS[@]}" -- --num-anchors 64 --batch-size 4
# shipped in bf16 (the shipped one: the fp32 average exported, the same tau on every prompt)
dflash average "$STAGE11-a/final" "$STAGE11-b/final" -o "$STAGE11" --save-dtype bfloat16
FINAL="$STAGE11"
# the runs that made FINAL, in order (an average stands for its runs): the peer (build_eagle3_draft.sh) gets their
# hours added up
printf '%s\n' "$TRAIN" "$STAGE2" "$STAGE3" "$STAGE4" "$STAGE5" "$STAGE6" "$STAGE7" "$STAGE8" "$STAGE9" "$STAGE10" \
    "$STAGE11" > "$WORK/stages.txt"

# 3. held-out tau and per-slot acceptance (40 prompts x 128 tokens of each test set), and the speed-up, measured
#    side by side with plain decoding
dflash evaluate --draft "$FINAL" --block-size "$BLOCK" --topk "" --threads "$THREADS" --out "$WORK/evaluate"
mkdir -p "$WORK/bench"
dflash bench --model "$MODEL" --draft "$FINAL" --methods ar,dflash,dflash-adaptive --num-prompts 20 --max-new-tokens 256 \
    --threads "$THREADS" --out "$WORK/bench" | tee "$WORK/bench/table.txt"

# 4. ship it: weights, config, and a model card generated from the run's own records (ABLATION=ablation.json of
#    scripts/ablation_table.py adds the recipe comparison)
mkdir -p "$SHIP"
cp "$FINAL/model.safetensors" "$FINAL/config.json" "$SHIP/"
CARD=(); for d in "${ALL[@]}"; do CARD+=(--data "$d"); done
[ -n "${ABLATION:-}" ] && CARD+=(--ablation "$ABLATION")
TRAINS=(); while read -r run; do TRAINS+=(--train "$run"); done < "$WORK/stages.txt"
python scripts/model_card.py "${TRAINS[@]}" "${CARD[@]}" --bench "$WORK/bench" \
    --evaluate "$WORK/evaluate" --out "$SHIP/README.md"
