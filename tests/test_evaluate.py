"""`dflash evaluate`: per-slot acceptance that adds up to τ, on held-out prompts, from the command line too."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash import DFlashDraftModel, spec_generate
from dflash.evaluate import EvalConfig, evaluate_draft, paired_tau_difference, slot_acceptance, tau_by_category
from dflash.generate import default_stop_token_ids
from test_cli import common, run, setup  # noqa: F401  (the tiny GGUF target and its draft)
from tiny import tiny_target

COMPARE = Path(__file__).resolve().parents[1] / "scripts" / "compare_evaluations.py"


def test_slot_acceptance_is_conditional_on_the_slots_before():
    # lengths count committed tokens (the target's own included): 1 = nothing drafted accepted
    lengths = [1, 2, 2, 3, 4, 4, 4, 1]
    rates = slot_acceptance(lengths, 4)
    assert rates == [6 / 8, 4 / 6, 3 / 4]
    assert slot_acceptance([1, 1], 3) == [0.0, 0.0] and slot_acceptance([], 3) == [0.0, 0.0]


def test_tau_is_one_plus_the_sum_of_products_of_slot_rates():
    target = tiny_target("qwen3", seed=5)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    g = torch.Generator().manual_seed(1)
    prompts = {"a": [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 3)],
               "b": [torch.randint(3, 96, (7,), generator=g).tolist()]}
    res = evaluate_draft(target, draft, prompts, EvalConfig(max_new_tokens=20, batch_size=2), progress=False)
    assert res["block_size"] == 4 and set(res["datasets"]) == {"a", "b"}
    for name, r in res["datasets"].items():
        prod, total = 1.0, 1.0
        for rate in r["slot_acceptance"]:
            prod *= rate
            total += prod
        assert r["tau"] == pytest.approx(total)
        assert sum(r["acceptance_histogram"]) == r["steps"] and r["prompts"] == len(prompts[name])
    # the same steps as decoding each prompt on its own (greedy, fp32)
    lengths = []
    for p in prompts["b"]:
        lengths += spec_generate(target, draft, torch.tensor([p]), max_new_tokens=20, return_stats=True,
                                 stop_token_ids=default_stop_token_ids(target)).acceptance_lengths
    assert res["datasets"]["b"]["tau"] == pytest.approx(sum(lengths) / len(lengths))


def test_evaluate_keeps_each_prompts_steps_in_the_sets_order_as_decoding_it_alone_gives_them():
    target = tiny_target("llama", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 3, 6, 4, 11)]  # not sorted by length
    res = evaluate_draft(target, draft, {"a": prompts}, EvalConfig(max_new_tokens=16, batch_size=2), progress=False)
    r = res["datasets"]["a"]
    assert sum(s for s, _ in r["per_prompt"]) == r["steps"]
    assert sum(t for _, t in r["per_prompt"]) / r["steps"] == pytest.approx(r["tau"])
    for p, (steps, tokens) in zip(prompts, r["per_prompt"]):
        out = spec_generate(target, draft, torch.tensor([p]), max_new_tokens=16, return_stats=True,
                            stop_token_ids=default_stop_token_ids(target))
        assert (steps, tokens) == (len(out.acceptance_lengths), sum(out.acceptance_lengths))
        assert (out.row_steps, out.row_accepted) == ([steps], [tokens])


def _results(per_set: dict, **settings) -> dict:
    config = {"num_prompts": 4, "max_new_tokens": 128, "prompts": None, "prompt_lookup": False, **settings}
    return {"block_size": 8, "config": config,
            "datasets": {name: {"tau": sum(t for _, t in pp) / sum(s for s, _ in pp), "per_prompt": pp}
                         for name, pp in per_set.items()}}


def test_paired_tau_difference_tells_a_difference_on_every_prompt_from_none(tmp_path):
    base = _results({"a": [[10, 20], [20, 30], [8, 30], [12, 12]], "b": [[5, 10], [6, 9], [10, 30], [7, 7]]})
    same = paired_tau_difference(base, base, resamples=500)
    for r in [*same["datasets"].values(), same["mean"]]:
        assert r["difference"] == 0 and r["low"] == r["high"] == 0 and r["share_not_above_zero"] == 1
    # one step fewer on every prompt of a: a is better beyond doubt; b unchanged
    better = _results({"a": [[9, 20], [19, 30], [7, 30], [11, 12]], "b": base["datasets"]["b"]["per_prompt"]})
    d = paired_tau_difference(base, better, resamples=500)
    a = d["datasets"]["a"]
    assert a["difference"] == pytest.approx(92 / 46 - 92 / 50) and 0 < a["low"] <= a["difference"] <= a["high"]
    assert a["share_not_above_zero"] == 0 and d["datasets"]["b"]["difference"] == 0
    assert a["ratio"] == pytest.approx(2.0 / 1.84) and 1 < a["ratio_low"] <= a["ratio"] <= a["ratio_high"]
    assert d["mean"]["difference"] == pytest.approx(a["difference"] / 2) and d["mean"]["low"] > 0
    # prompts that go both ways, the same steps in all: not told from no difference
    mixed = _results({"a": [[7, 20], [21, 30], [9, 30], [13, 12]], "b": base["datasets"]["b"]["per_prompt"]})
    m = paired_tau_difference(base, mixed, resamples=2000)["datasets"]["a"]
    assert m["low"] < 0 < m["high"] and 0 < m["share_not_above_zero"] < 1
    # what cannot be compared, by name
    for other, words in ((_results({"a": [[1, 1]] * 4, "b": [[1, 1]] * 4}, max_new_tokens=64), "max_new_tokens"),
                         (_results({"a": [[1, 1]] * 4}), "lacks b"),
                         (_results({"a": [[1, 1]] * 3, "b": [[1, 1]] * 4}), "4 prompts against 3")):
        with pytest.raises(ValueError, match=words):
            paired_tau_difference(base, other)
    old = json.loads(json.dumps(base))
    del old["datasets"]["a"]["per_prompt"]
    with pytest.raises(ValueError, match="no per-prompt counts"):
        paired_tau_difference(old, base)
    # the script: a table and one JSON line
    for name, res in (("base", base), ("better", better)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    out = subprocess.run([sys.executable, str(COMPARE), tmp_path / "base", tmp_path / "better", "--resamples", "200"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| a | 1.840 | 2.000 | +0.160 |" in out.stdout and "| mean |" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1])["datasets"]["b"]["difference"] == 0


def test_evaluate_with_prompt_lookup_counts_what_generate_with_it_accepts():
    target = tiny_target("qwen3", seed=3)  # a seed whose greedy answer to this prompt repeats itself
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    prompt = [1, 2, 9, 10, 11, 9, 10, 11, 9, 10]
    taus = {}
    for lookup in (False, True):
        res = evaluate_draft(target, draft, {"a": [prompt]}, EvalConfig(max_new_tokens=30, prompt_lookup=lookup),
                             progress=False)
        out = spec_generate(target, draft, torch.tensor([prompt]), max_new_tokens=30, return_stats=True,
                            stop_token_ids=default_stop_token_ids(target), prompt_lookup=lookup)
        taus[lookup] = res["datasets"]["a"]["tau"]
        assert taus[lookup] == pytest.approx(out.tau)
    assert taus[True] > taus[False] + 0.05, taus


def test_evaluate_command_writes_table_json_and_plot(tiny_gguf, setup, tmp_path):
    home, draft = setup
    prompts = tmp_path / "held-out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, **({"category": c} if c else {})}) + "\n"
                               for p, c in (("hello the", "w"), ("the cat", None), ("a b c", "w"), ("x", "r"))))
    r = run("evaluate", *common(tiny_gguf)[:2], "--dtype", "float32", "--threads", "1", "--draft", draft,
            "--prompts", prompts, "--num-prompts", "3", "--max-new-tokens", "12", "--batch-size", "2",
            "--topk", "1,2", "--out", tmp_path / "out", env_home=home)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["block_size"] == 4 and line["tau_held-out"] >= 1.0
    assert "| held-out |" in r.stdout and "slot 3" in r.stdout and "| held-out | 2 |" in r.stdout
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["datasets"]["held-out"]["prompts"] == 3 and saved["hardware"]
    assert (tmp_path / "out" / "slot_acceptance.png").read_bytes()[:4] == b"\x89PNG"
    held = saved["datasets"]["held-out"]
    assert len(held["per_prompt"]) == 3
    # tau per category: the first three prompts' kinds (the second has none); "w" sums its two prompts' counts
    (s0, t0), _, (s2, t2) = held["per_prompt"]
    assert set(held["by_category"]) == {"w"} and held["by_category"]["w"] == {
        "tau": pytest.approx((t0 + t2) / (s0 + s2)), "steps": s0 + s2, "prompts": 2}
    assert "| held-out | w |" in r.stdout
    # the draft's proposals from a vocabulary it keeps, then from the whole one
    limited = tmp_path / "limited"
    shutil.copytree(draft, limited)
    weights = load_file(limited / "model.safetensors")
    weights["draft_vocab"] = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34])
    save_file(weights, limited / "model.safetensors")
    whole = saved["proposal_vocabulary"]  # the draft keeps none
    assert whole > 8
    for extra, size in (((), 8), (("--whole-vocabulary",), whole)):
        r = run("evaluate", *common(tiny_gguf)[:2], "--dtype", "float32", "--threads", "1", "--draft", limited,
                "--prompts", prompts, "--num-prompts", "3", "--max-new-tokens", "12", "--topk", "", *extra,
                "--out", tmp_path / f"out{len(extra)}", env_home=home)
        assert r.returncode == 0, r.stderr
        assert json.loads((tmp_path / f"out{len(extra)}" / "results.json").read_text())["proposal_vocabulary"] == size


def test_tau_by_category_sums_steps_and_tokens_of_each_kind():
    per_prompt = [[10, 20], [4, 4], [6, 18], [5, 5]]
    got = tau_by_category(per_prompt, ["a", None, "a", "b"])
    assert got == {"a": {"tau": 38 / 16, "steps": 16, "prompts": 2}, "b": {"tau": 1.0, "steps": 5, "prompts": 1}}
    assert tau_by_category(per_prompt, [None] * 4) == {}
    with pytest.raises(ValueError):
        tau_by_category(per_prompt, ["a"])


def test_topk_hit_rates_grow_with_k_and_reach_one_at_the_whole_vocabulary():
    from dflash.evaluate import topk_hits

    target = tiny_target("llama", seed=5)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    g = torch.Generator().manual_seed(3)
    texts = [(torch.randint(3, 96, (n,), generator=g).tolist(), p) for n, p in ((20, 6), (15, 9))]
    repeated = torch.randint(3, 96, (8,), generator=g).tolist()
    texts.append((repeated + repeated + [4, 5], 4))  # its second half is copyable
    rates, split = topk_hits(target, draft, texts, [1, 3, 96], 4)
    assert list(rates) == ["1", "3", "96"] and all(len(r) == 3 for r in rates.values())
    assert all(a <= b <= c for a, b, c in zip(rates["1"], rates["3"], rates["96"]))
    assert rates["96"] == [1.0, 1.0, 1.0] and draft.config.block_size == 4
    # the copy/novel split partitions slot 1's tokens: its two rates average, by their shares, to the top-1 rate
    share = split["copy_share"]
    assert 0.0 < share < 1.0
    assert share * split["copy"][0] + (1 - share) * split["novel"][0] == pytest.approx(rates["1"][0])


def test_an_eagle_draft_is_evaluated_without_the_block_slots_top_k():
    # teacher-forced top-k reads one block forward's slots, which a chain drafter has not: its τ is measured, the
    # top-k is skipped with a warning instead of failing inside the draft's layers
    from dflash.eagle import Eagle3DraftModel

    target = tiny_target("llama", seed=2)
    draft = Eagle3DraftModel.from_target(target, block_size=4)
    with pytest.warns(UserWarning, match="EAGLE-3-style"):
        res = evaluate_draft(target, draft, {"a": [[5, 6, 7, 8, 9]]}, EvalConfig(max_new_tokens=12, topk=[1, 2]),
                             progress=False)
    assert res["datasets"]["a"]["steps"] > 0 and "topk_hits" not in res["datasets"]["a"]


def test_copyable_tokens_are_those_prompt_lookup_guesses_from_the_text_before():
    from dflash.evaluate import copyable

    ids = [5, 6, 7, 8, 5, 6, 7, 9, 4, 6, 7, 9]
    # from position 3 on: the 7 at 6 follows "5 6" as before; the 9 at 7 follows "5 6 7", which went on with 8;
    # the 7 at 10 follows "4 6", never seen (one token alone is not looked up); the 9 at 11 follows "6 7", whose
    # latest occurrence went on with 9
    assert copyable(ids, 3) == [False, False, False, True, False, False, False, False, True]
