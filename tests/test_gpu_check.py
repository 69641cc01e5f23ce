"""The prepared GPU check runs end to end in its dry mode (the CPU, small shapes): tests, measurements, JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_gpu_check_dry_mode_runs_end_to_end():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--small"], cwd=ROOT,
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "verify 16 tokens" in r.stdout and "draft propose" in r.stdout
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(result["verify_ms_fast"]) == {"1", "2", "4", "8", "16"} and result["propose_ms"] > 0
    assert result["prefill_ms"].keys() == {"128", "512"}
