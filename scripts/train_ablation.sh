#!/usr/bin/env bash
# One arm of the recipe comparison for the default model's draft (issue 25): equal wall-clock (--max-hours), or
# equal steps (STEPS=N: the machine's speed drifts by 2x between hours, so equal hours can mean unequal work), the
# same data, the same held-out evaluation (GSM8K, MBPP, HumanEval, MT-Bench test prompts). Resumable: rerun the
# same arm. Then `python scripts/ablation_table.py runs/train/*/ --out runs/train/ablation` compares them.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/train_ablation.sh r0     # THREADS=1 HOURS=2 by default
#
# FEATURES=DIR reads the target's features from a cache instead of running the target every step (a large part of
# a step on a CPU; the same training), made once for all arms, with the target's top 32 tokens after every
# position for r8 and r20 (which then distil from those: --distill-topk 32, not the whole distribution):
#   dflash features --data data/smollm2-135m-instruct/first --features runs/features/first --num-target-features 3 \
#       --max-length 1536 --distill-topk 32 --threads 1
#
# Arms: r0 the baseline (1 layer, block 8, every answer position an anchor, fresh layers, lr 6e-4); r1 2 layers; r2
# 3 layers; r3 layers copied from the target's last ones; r4 block 16; r5 gamma 7 (flatter slot weights); r6 128
# anchors per sequence; r7 lr 1e-3; r8 half the loss from the target's own distribution (--distill); r9 as many
# key/value heads as attention heads (the target has 3 of 9, so each context position reaches a layer through 192 of
# its 576 dimensions); r10 4 sequences of 64 anchors a step instead of one of up to 512 (about the same blocks a
# step, 4x the sequences: the anchors of one answer share most of their context, so their gradients are alike;
# without FEATURES each step runs the target 4 times); r11 8 sequences of 32 anchors a step; r12 r10 with r9's
# heads; r13 r12 with 2 layers; r14 16 sequences of 16 anchors; r15 r11 with r9's heads; r16 r15 with 2 layers; r17
# r15 with gamma 7; r18 r15 trained at block 16 (evaluated at 8, as every arm); r19 r15 with its layer copied from
# the target's last; r20 r15 with r8's distillation; r21 r15 with 3 layers; r22 r21 grown from the shipped draft
# (its trained layer, then two that start as the identity: a second stage that reuses the first's hours; the shipped
# draft saw these answers too, but the evaluation is on test prompts); r23 r22 with r20's distillation; r24 r15
# reading 5 target layers instead of 3 (its FEATURES cache made with --num-target-features 5); r25 r24 with 5
# layers (the published drafts' shape: 5 layers reading 5 target layers). e0 is the
# EAGLE-3-style peer on the same data, features and evaluation (a chain of 7 at verify width 8, 128 anchors a
# sequence as its build script trains it): give it the hours a DFlash arm took (HOURS=...) for the comparison at
# equal compute; e1 is e0 reading r24's 5 target layers (r24's cache), its peer at equal hours.
#
# DATA="folder ..." trains on other data (default: the first 3104 answers); FEATURES then names one cache for all,
# or one per DATA folder, space-separated; OUT=folder keeps such a run apart from the arm's (runs/train/ARM).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding chat/, gsm8k/, mbpp/}"
ARM="${1:?name an arm: r0..r25, e0, e1}"
THREADS="${THREADS:-1}"
HOURS="${HOURS:-2}"
# STEPS=N: a budget of N steps instead of HOURS (equal compute where the machine's speed drifts)
BUDGET=(--max-hours "$HOURS")
[ -n "${STEPS:-}" ] && BUDGET=(--schedule-steps "$STEPS")
CACHE=()
# shellcheck disable=SC2206
[ -n "${FEATURES:-}" ] && CACHE=(--features $FEATURES)  # one folder, or one per DATA folder (space-separated)
# COMPILE=1: the training step through torch.compile (the same training, faster steps; the table says which ran so)
[ -n "${COMPILE:-}" ] && CACHE+=(--compile)
case "$ARM" in r8|r20|r23) [ -n "${FEATURES:-}" ] && CACHE+=(--distill-topk 32) ;; esac
# a fixed set (a resumed run must see the same data): the committed greedy answers to the first 3104 prompts
DATA="${DATA:-data/smollm2-135m-instruct/first}"
case "$ARM" in
    r0) EXTRA=() ;;
    r1) EXTRA=(--num-layers 2) ;;
    r2) EXTRA=(--num-layers 3) ;;
    r3) EXTRA=(--init-from-target) ;;
    r4) EXTRA=(--block-size 16) ;;
    r5) EXTRA=(--gamma 7) ;;
    r6) EXTRA=(--num-anchors 128) ;;
    r7) EXTRA=(--lr 1e-3) ;;
    r8) EXTRA=(--distill 0.5) ;;
    r9) EXTRA=(--num-kv-heads 9) ;;
    r10) EXTRA=(--num-anchors 64 --batch-size 4) ;;
    r11) EXTRA=(--num-anchors 32 --batch-size 8) ;;
    r12) EXTRA=(--num-anchors 64 --batch-size 4 --num-kv-heads 9) ;;
    r13) EXTRA=(--num-anchors 64 --batch-size 4 --num-kv-heads 9 --num-layers 2) ;;
    r14) EXTRA=(--num-anchors 16 --batch-size 16) ;;
    r15) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9) ;;
    r16) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --num-layers 2) ;;
    r17) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --gamma 7) ;;
    r18) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --block-size 16) ;;
    r19) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --init-from-target) ;;
    r20) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --distill 0.5) ;;
    r21) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --num-layers 3) ;;
    r22) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --num-layers 3
                --init-draft src/dflash/drafts/smollm2-135m-instruct) ;;
    r23) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --num-layers 3
                --init-draft src/dflash/drafts/smollm2-135m-instruct --distill 0.5) ;;
    r24) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --num-target-features 5) ;;
    r25) EXTRA=(--num-anchors 32 --batch-size 8 --num-kv-heads 9 --num-target-features 5 --num-layers 5) ;;
    e0) EXTRA=(--method eagle3 --num-anchors 128) ;;
    e1) EXTRA=(--method eagle3 --num-anchors 128 --num-target-features 5) ;;
    *) echo "train_ablation.sh: unknown arm $ARM" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086
dflash train --target smollm2-135m-instruct --data $DATA --output "${OUT:-runs/train/$ARM}" \
    --num-layers 1 --num-target-features 3 --block-size 8 --num-anchors 512 --lr 6e-4 --epochs 4 \
    "${BUDGET[@]}" --warmup 0.04 --draft-vocab-size 8192 --max-length 1536 --autocast auto \
    --eval-datasets gsm8k mbpp humaneval mt-bench --eval-prompts 10 --eval-max-new-tokens 64 --eval-interval 500 \
    --save-interval 100 --save-dtype bfloat16 --log-interval 20 --threads "$THREADS" --resume "${CACHE[@]}" "${EXTRA[@]}"
