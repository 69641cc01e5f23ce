#!/usr/bin/env bash
# The target's own answers for training the default model's drafts (issue 25's data at scale), in four parts:
#   first/         greedy answers to the first 3104 training prompts of regenerate's fixed order
#   rest/answers/  greedy answers to the other 6313 (continues ../shared/data/regen-smollm2, copied here)
#   self-answers/  greedy answers to prompts the target wrote itself (self-prompts/: sampled user turns)
#   sampled-1/     a second, sampled answer (temperature 0.8) to the first 3104 prompts
#   code-complete/ greedy answers to MBPP's train tasks posed as HumanEval poses its tasks (mbpp:train-complete:
#                  a stub to complete), and code-complete-s1/, -s2/: two sampled answers to each (temperature 0.8)
#   task-answers/  greedy answers to prompts the target wrote from given openings (task-prompts/: "Write a poem",
#                  "Act as", ...: writing, role-play and reasoning tasks, which the plain template seldom brings)
#   task-answers-2/ the same from other openings (task-prompts-2/: travel posts, reviews, dialogues, personas,
#                  riddles, extraction and summaries, STEM and humanities questions, code to write or fix: the kinds
#                  of MT-Bench's and HumanEval's prompts that the first openings seldom bring)
#   task-answers-3/ the same from a third set (task-prompts-3/: haiku, lyrics, diary entries, news, cover letters,
#                  toasts, advertisements, scenes, characters, stories, advice, plans, lessons, debates, replies in
#                  a role: more of the writing and role-play that MT-Bench asks for and the draft accepts least)
# Every step resumes where it stopped: rerun the script (in the background; THREADS=1 leaves a core free).
# Chunks already packed into data/smollm2-135m-instruct/<part>/ (committed, so they outlive runs/ and the machine)
# are not answered again; keep them with `dflash pack runs/data/<part> -o data/smollm2-135m-instruct/<part>`.
#
#   DFLASH_DATA_DIR=../shared/data bash scripts/build_training_data.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_DATA_DIR:?point DFLASH_DATA_DIR at the folder holding chat/, gsm8k/, mbpp/, regen-smollm2/}"
export DFLASH_DATA_DIR="$(cd "$DFLASH_DATA_DIR" && pwd)"
WORK="$(mkdir -p "${WORK:-runs/data}" && cd "${WORK:-runs/data}" && pwd)"
THREADS="${THREADS:-2}"
SELF_PROMPTS="${SELF_PROMPTS:-6000}"
TASK_PROMPTS="${TASK_PROMPTS:-100}"  # per opening
COMMON=(--model smollm2-135m-instruct --no-draft --max-new-tokens 512 --threads "$THREADS")
KEPT="$PWD/data/smollm2-135m-instruct"
kept() { if [ -f "$KEPT/$1/manifest.json" ]; then echo --packed "$KEPT/$1"; fi; }

dflash regenerate chat gsm8k:train mbpp:train -o "$WORK/first" --limit 3104 --batch-size 32 "${COMMON[@]}" $(kept first)

if [ ! -d "$WORK/rest" ]; then
    cp -r "$DFLASH_DATA_DIR/regen-smollm2" "$WORK/rest.tmp" && chmod -R u+w "$WORK/rest.tmp" && mv "$WORK/rest.tmp" "$WORK/rest"
fi
(cd "$WORK/rest" && dflash regenerate rest-prompts.jsonl -o answers --batch-size 32 "${COMMON[@]}" $(kept rest))

# prompts the target writes itself (sampled user turns, one or more `self:` sources), then its greedy answers
written() {  # prompts folder, answers folder, sources...
    local prompts=$1 answers=$2; shift 2
    dflash regenerate "$@" -o "$WORK/$prompts" --batch-size 64 --temperature 0.8 --top-p 0.95 \
        --model smollm2-135m-instruct --no-draft --max-new-tokens 192 --threads "$THREADS"
    dflash regenerate "$WORK/$prompts" -o "$WORK/$answers" --batch-size 32 "${COMMON[@]}" $(kept "$answers")
}
# the same from given openings, TASK_PROMPTS prompts each
tasks() {  # prompts folder, answers folder, openings...
    local prompts=$1 answers=$2 sources=(); shift 2
    for o in "$@"; do sources+=("self:$TASK_PROMPTS:$o"); done
    written "$prompts" "$answers" "${sources[@]}"
}

written self-prompts self-answers "self:$SELF_PROMPTS"

dflash regenerate chat gsm8k:train mbpp:train -o "$WORK/sampled-1" --limit 3104 --batch-size 32 --temperature 0.8 \
    --seed 1 "${COMMON[@]}" $(kept sampled-1)

dflash regenerate mbpp:train-complete -o "$WORK/code-complete" --batch-size 32 "${COMMON[@]}" $(kept code-complete)
for seed in 1 2; do
    dflash regenerate mbpp:train-complete -o "$WORK/code-complete-s$seed" --batch-size 32 --temperature 0.8 \
        --seed "$seed" "${COMMON[@]}" $(kept code-complete-s$seed)
done

tasks task-prompts task-answers "Write a short story" "Write a poem" "Write a blog post" "Write a letter" \
    "Write an email" "Write a speech" "Write a product description" "Write a persuasive essay" "Compose" "Draft" \
    "Rewrite" "Describe" "Act as" "Pretend you are" "Imagine you are" "You are a" "Explain" "Suppose" \
    "What would happen if" "Compare"
tasks task-prompts-2 task-answers-2 "Write a travel blog post" "Write a review of" "Write a dialogue between" \
    "Edit the following paragraph" "Embody the persona of" "Role-play as" "As a" "Solve this riddle" \
    "Which is more likely" "Calculate" "Extract" "Summarize" "Identify" "How does" "Why do" "Discuss" "Analyze" \
    "Write a Python function" "Implement a" "Fix the bug in"
tasks task-prompts-3 task-answers-3 "Write a haiku" "Write a limerick" "Write song lyrics" "Write a diary entry" \
    "Write a news article" "Write a cover letter" "Write a toast" "Write an advertisement" "Write a motivational" \
    "Write a scene" "Write the opening paragraph" "Create a character" "Tell me a story" "Give me advice on" \
    "Plan a" "Brainstorm" "Teach me" "Debate" "Convince me" "Respond as"
