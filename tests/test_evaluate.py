"""`dflash evaluate`: per-slot acceptance that adds up to τ, on held-out prompts, from the command line too."""

import json

import pytest
import torch

from dflash import DFlashDraftModel, spec_generate
from dflash.evaluate import EvalConfig, evaluate_draft, slot_acceptance
from dflash.generate import default_stop_token_ids
from test_cli import common, run, setup  # noqa: F401  (the tiny GGUF target and its draft)
from tiny import tiny_target


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
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello the", "the cat", "a b c", "x")))
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
