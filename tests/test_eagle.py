"""The EAGLE-3-style chain drafter: exact greedy output, chain == unrolled training forward, it learns."""

import json

import pytest
import torch

from dflash import DFlashDraftModel, load_draft, spec_generate
from dflash.eagle import Eagle3DraftModel, Eagle3TrainStep, ttt_masks
from dflash.engine import LLMEngine
from dflash.errors import DFlashConfigError, DFlashInputError
from dflash.model import DraftKVCache
from dflash.train import target_features, train
from test_lossless import MAX_NEW, new_tokens, references
from test_train import answer_tau, cfg_for, lang  # noqa: F401  (the structured target and its regenerated data)
from tiny import ragged_batch, tiny_target


class ChainOracle(Eagle3DraftModel):
    """Runs the real chain, then replaces its proposals by the target's own future tokens (known in advance),
    so that long acceptances, per-row ragged commits and the cache bookkeeping after them are exercised."""

    def __init__(self, base, futures):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self._target_modules = base._target_modules
        self.futures = futures

    def chain(self, stream, u, pos, cache, ctx_valid, k):
        real = super().chain(stream, u, pos, cache, ctx_valid, k)
        out = real.clone()
        for r in range(out.shape[0]):
            seq = self.futures[r]
            for i in range(k):
                p = int(pos[r]) + 2 + i  # entry at position pos predicts the token two places on
                if p < len(seq) and (p + r) % 5:  # every fifth proposal is left wrong
                    out[r, i] = seq[p]
        return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_chain_drafts_match_target_greedy(arch):
    target = tiny_target(arch, seed=1)
    lengths = [3, 11, 6, 9]
    ids, mask = ragged_batch(lengths, seed=4)
    refs = references(target, ids, mask, MAX_NEW)
    futures = [ids[i][mask[i].bool()].tolist() + refs[i] for i in range(len(lengths))]
    for B in (2, 5, 8):
        base = Eagle3DraftModel.from_target(target, block_size=B)
        for draft, name in ((base, "random"), (ChainOracle(base, futures), "oracle")):
            out = spec_generate(target, draft, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[],
                                return_stats=True)
            assert new_tokens(out, ids, out.num_new_tokens) == refs, (arch, B, name)
            if name == "oracle":
                assert out.tau > 1 + 0.4 * min(B - 1, 4), (arch, B, out.tau)  # long chains really were accepted


def test_inference_chain_equals_the_unrolled_training_forward():
    """Proposals made one at a time from the cache equal the argmax of the training unroll, when the text
    after the anchor is the chain's own proposals (what the training-time test assumes of accepted drafts)."""
    torch.manual_seed(0)
    target = tiny_target("llama", seed=3)
    draft = Eagle3DraftModel.from_target(target, block_size=5)
    a, k = 9, 4
    x = torch.randint(3, 60, (a + 1,))
    feats = target_features(target, draft.config.target_layer_ids, x)  # [a+1, F]
    cache = DraftKVCache(draft.config, 1, 32, x.device, torch.float32)
    cache.positions[0, :a] = torch.arange(a)
    stream, u = draft.write_entries(feats[None, :a], x[None, 1:a + 1], cache, 0)
    chain = draft.chain(stream[:, -1], u[:, -1], torch.tensor([a - 1]), cache, torch.ones(1, a, dtype=torch.bool), k)
    full = torch.cat([x, chain[0]])
    unrolled = Eagle3TrainStep(draft, k).unrolled(
        target_features(target, draft.config.target_layer_ids, full), full)
    got = [int(draft.head_argmax(s[None, a - 1:a])[0, 0]) for s in unrolled]
    assert got == chain[0].tolist()


def test_training_masks_see_context_then_own_chain():
    m = ttt_masks(4, 3, "cpu")
    assert m[0].tolist() == torch.ones(4, 4).tril().bool().tolist()
    assert m[2].shape == (4, 12)
    row = m[2][2].tolist()  # step 2, entry 2: context 0..2, then entry 2 of steps 1 and 2
    assert row == [True, True, True, False] + [False, False, True, False] * 2


def test_eagle3_trainer_learns_saves_and_reloads(lang, tmp_path):  # noqa: F811
    target, tok, root = lang
    tau = answer_tau(target, root, 8)

    assert tau(Eagle3DraftModel.from_target(target, block_size=5)) < 1.5
    train(cfg_for(root, tmp_path / "run", method="eagle3", block_size=5, epochs=6), target=target, tokenizer=tok,
          progress=False)
    draft = load_draft(tmp_path / "run" / "final", target)
    assert isinstance(draft, Eagle3DraftModel) and draft.config.draft_method == "eagle3"
    with pytest.raises(DFlashConfigError, match="holds a eagle3 draft, not a dflash one"):
        DFlashDraftModel.from_pretrained(tmp_path / "run" / "final", target=target)
    saved = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert saved["architectures"] == ["Eagle3DraftModel"] and saved["draft_method"] == "eagle3"
    assert tau(draft) >= 2.5
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert losses[-1] < 0.5 * losses[0]
    assert len(log[-2]["acc_by_slot"]) == 4  # one accuracy per unrolled step


def test_method_and_draft_kind_must_agree(lang, tmp_path):  # noqa: F811
    from dflash.errors import DFlashError

    target, tok, root = lang
    with pytest.raises(DFlashError, match="unknown --method 'medusa'"):
        train(cfg_for(root, tmp_path / "a", method="medusa"), target=target, tokenizer=tok, progress=False)
    DFlashDraftModel.from_target(target, block_size=4, mask_token_id=38).save_pretrained(tmp_path / "dflash")
    with pytest.raises(DFlashError, match="--method eagle3 but the starting draft is a dflash draft"):
        train(cfg_for(root, tmp_path / "b", method="eagle3", init_draft=str(tmp_path / "dflash")), target=target,
              tokenizer=tok, progress=False)
    with pytest.raises(DFlashInputError, match="runs DFlash drafts; this is a eagle3 draft"):
        LLMEngine(target, tok, Eagle3DraftModel.from_target(target, block_size=4))


def test_a_bf16_chain_drafter_decodes_as_the_target_does():
    # a batch prepares its draft before the first step (DFlashDraftModel.prepare): the chain drafter's layer is its
    # own, so it builds its proposal head only (building the DFlash layer stack from it failed on a bf16 draft)
    from dflash import ar_generate

    target = tiny_target("qwen3", seed=2).bfloat16()
    draft = Eagle3DraftModel.from_target(target, block_size=4).bfloat16()
    ids, mask = ragged_batch([5, 9], seed=3)
    out = spec_generate(target, draft, ids, mask, max_new_tokens=12, stop_token_ids=[], return_stats=True)
    ref = ar_generate(target, ids, mask, max_new_tokens=12, stop_token_ids=[], return_stats=True)
    assert out.num_new_tokens == [12, 12]
    assert new_tokens(out, ids, out.num_new_tokens) == new_tokens(ref, ids, ref.num_new_tokens)
