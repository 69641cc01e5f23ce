#!/usr/bin/env bash
# Trains the EAGLE-3-style peer for the default model at equal compute with the DFlash draft of
# scripts/build_default_draft.sh (run that first: its answer folders, feature cache and training run are this
# script's inputs), evaluates it on the DFlash draft's held-out sets, ships the peer beside the DFlash draft,
# benches every method on every dataset in one run and writes the peer's card, which holds per set DFlash's tau over
# the peer's.
# Rerunning resumes where it stopped, so the work can be spread over several sittings.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_eagle3_draft.sh
#
# Equal compute: the peer's cosine schedule is sized (--max-hours) to the wall-clock hours the DFlash draft took
# (every stage build_default_draft.sh trained, both runs of an averaged one, every sitting of each added up), on the
# same data and feature cache, in the same precision (--autocast auto), on THREADS threads as those; HOURS=H
# overrides that. Train both on the same machine: hours on two machines are not the same compute. The peer drafts a
# chain of CHAIN tokens, verified at width CHAIN+1 as DFlash's block of 8.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding chat/, gsm8k/, mbpp/}"
WORK="${WORK:-runs/default-draft}"
MODEL="smollm2-135m-instruct"
THREADS="${THREADS:-2}"
CHAIN="${CHAIN:-7}"                          # proposals per step (verify width CHAIN+1), unrolled in training
PROMPTS="${PROMPTS:-5}"                      # prompts per dataset in the bench
FOLDERS="${FOLDERS:-first rest self-answers sampled-1}"   # as build_default_draft.sh
SHIP="src/dflash/drafts/$MODEL-eagle3"
ALL=(); for f in $FOLDERS; do ALL+=(data/"$MODEL"/"$f"); done
CACHE=(); for d in "${ALL[@]}"; do CACHE+=("$WORK/features/$(basename "$d")"); done
DFLASH_EVAL="$WORK/evaluate"                 # the DFlash draft's held-out evaluation (build_default_draft.sh's)
[ -f "$WORK/stages.txt" ] && [ -f "$DFLASH_EVAL/results.json" ] || {
    echo "build_eagle3_draft.sh: no finished DFlash draft in $WORK (run build_default_draft.sh)" >&2; exit 2; }
HOURS="${HOURS:-$(PYTHONPATH=scripts python -c "import sys; from model_card import runs_of, stage; \
print(round(sum(stage(r)['wall'] for s in sys.argv[1:] for r in runs_of(s)) / 3600, 3))" $(cat "$WORK/stages.txt"))}"
echo "build_eagle3_draft.sh: the peer trains for the DFlash draft's $HOURS h" >&2

PEER="$WORK/eagle3"
dflash train --method eagle3 --target "$MODEL" --data "${ALL[@]}" --features "${CACHE[@]}" --output "$PEER" \
    --num-layers 1 --num-target-features 3 --block-size "$((CHAIN + 1))" --num-anchors 128 --lr 6e-4 --warmup 0.04 \
    --epochs 3 --max-hours "$HOURS" --draft-vocab-size 8192 --max-length 1536 --compile --autocast auto \
    --eval-interval 1000 --save-interval 100 --save-dtype bfloat16 --threads "$THREADS" --resume

# the same held-out evaluation as the DFlash draft's (40 prompts x 128 tokens of each test set, fixed width)
[ -f "$PEER/evaluate/results.json" ] || dflash evaluate --draft "$PEER/final" --block-size "$((CHAIN + 1))" \
    --topk "" --threads "$THREADS" --out "$PEER/evaluate"

mkdir -p "$SHIP"
cp "$PEER/final/model.safetensors" "$PEER/final/config.json" "$SHIP/"
# every method on the same prompts in one process; the shipped drafts are the defaults of --draft/--eagle-draft
mkdir -p "$WORK/bench-peers"
dflash bench --model "$MODEL" \
    --methods ar,dflash,dflash-adaptive,eagle3,eagle3-adaptive,ngram,hf,hf-prompt-lookup,hf-early-exit \
    --datasets gsm8k,math500,humaneval,mbpp --num-prompts "$PROMPTS" --max-new-tokens 256 \
    --threads "$THREADS" --out "$WORK/bench-peers" | tee "$WORK/bench-peers/table.txt"
CARD=(); for d in "${ALL[@]}"; do CARD+=(--data "$d"); done
python scripts/model_card.py --train "$PEER" "${CARD[@]}" --bench "$WORK/bench-peers" --evaluate "$PEER/evaluate" \
    --versus "the DFlash draft=$DFLASH_EVAL" --out "$SHIP/README.md"
sed -n '/^## Against/,/^$/p' "$SHIP/README.md"   # per set the DFlash draft's tau over the peer's
