#!/usr/bin/env bash
# The prepared GPU check (under 10 minutes on one GPU, nothing downloaded): the lossless and sampling tests on the
# device (tiny models), then scripts/gpu_check.py's measurements (an 8B-shaped Qwen3 and a 5-layer draft with
# random weights). --small: the dry mode (a few of the tests, small shapes), which the test suite runs on the CPU.
#
#   bash scripts/gpu_check.sh [--device cuda|cpu] [--small]
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
SMALL=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --small) SMALL="--small"; shift ;;
        *) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
SELECT=()
[ -n "$SMALL" ] && SELECT=(-k "test_stats_are_consistent or test_seeded_sampling_is_reproducible")
DFLASH_TEST_DEVICE="$DEVICE" "${PYTHON:-python}" -m pytest -q -x -p no:cacheprovider tests/test_lossless.py tests/test_sampling.py \
    "${SELECT[@]}"
"${PYTHON:-python}" scripts/gpu_check.py --device "$DEVICE" $SMALL
