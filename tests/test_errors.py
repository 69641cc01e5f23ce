"""Bad input raises an exception whose message names the problem."""

import pytest
import torch

from dflash import DFlashConfigError, DFlashDraftModel, DFlashError, DFlashInputError, ar_generate, spec_generate
from tiny import ragged_batch, tiny_target


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", seed=0)
    return target, DFlashDraftModel.from_target(target, block_size=4)


def test_draft_from_another_target(pair):
    target, _ = pair
    other = tiny_target("llama", seed=0, layers=6)
    wrong_depth = DFlashDraftModel.from_target(other, block_size=4)
    with pytest.raises(DFlashConfigError, match="6-layer target.*4 layers"):
        spec_generate(target, wrong_depth, torch.tensor([[5, 6, 7]]))
    import transformers as tf

    wide = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2))
    with pytest.raises(DFlashConfigError, match="hidden size 32 != target hidden size 64"):
        spec_generate(target, DFlashDraftModel.from_target(wide), torch.tensor([[5, 6, 7]]))


def test_layer_ids_out_of_range(pair):
    target, _ = pair
    with pytest.raises(DFlashConfigError, match=r"target_layer_ids \[1, 7\] out of range.*4 layers"):
        DFlashDraftModel.from_target(target, target_layer_ids=[1, 7])
    with pytest.raises(DFlashConfigError, match="out of range"):
        DFlashDraftModel.from_target(target, target_layer_ids=[-1])


def test_block_size(pair):
    target, draft = pair
    with pytest.raises(DFlashConfigError, match="block_size must be >= 2"):
        DFlashDraftModel.from_target(target, block_size=1)
    with pytest.raises(DFlashInputError, match="block size must be an integer >= 2"):
        spec_generate(target, draft, torch.tensor([[5, 6]]), block_size=1)
    with pytest.raises(DFlashInputError, match="disagree"):
        spec_generate(target, draft, torch.tensor([[5, 6]]), block_size=4, num_speculative_tokens=8)


def test_mask_token_outside_vocab(pair):
    target, _ = pair
    with pytest.raises(DFlashConfigError, match="mask_token_id 500 is outside the vocabulary"):
        DFlashDraftModel.from_target(target, mask_token_id=500)


def test_draft_vocabulary_outside_the_target_vocabulary():
    target = tiny_target("llama", seed=0)
    draft = DFlashDraftModel.from_target(target, block_size=4)
    size = target.config.vocab_size
    with pytest.raises(DFlashConfigError, match=f"token ids in 0..{size - 1} .* from 3 to {size}"):
        draft.set_draft_vocab([3, 7, size])
    with pytest.raises(DFlashConfigError, match="at least one token id"):
        draft.set_draft_vocab([])
    draft.set_draft_vocab([5, 3, 5])
    assert draft.draft_vocab.tolist() == [3, 5]


def test_prompt_problems(pair):
    target, draft = pair
    with pytest.raises(DFlashInputError, match="empty prompt"):
        spec_generate(target, draft, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(DFlashInputError, match=r"empty prompt in batch row\(s\) \[1\]"):
        spec_generate(target, draft, torch.tensor([[5, 6], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(DFlashInputError, match="attention_mask shape"):
        spec_generate(target, draft, torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1]]))
    with pytest.raises(DFlashInputError, match="pad on the left"):
        ar_generate(target, torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]))
    with pytest.raises(DFlashInputError, match="outside the vocabulary"):
        ar_generate(target, torch.tensor([[5, 600]]))
    with pytest.raises(DFlashInputError, match="prompt too long.*512"):
        ar_generate(target, torch.full((1, 500), 5), max_new_tokens=20)


def test_generation_parameters(pair):
    target, draft = pair
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(DFlashInputError, match="max_new_tokens must be an integer >= 0"):
        spec_generate(target, draft, ids, max_new_tokens=-1)
    with pytest.raises(DFlashInputError, match="temperature"):
        spec_generate(target, draft, ids, temperature=-0.5)
    with pytest.raises(DFlashInputError, match="top_p"):
        spec_generate(target, draft, ids, temperature=1.0, top_p=0.0)
    with pytest.raises(DFlashInputError, match="top_k"):
        spec_generate(target, draft, ids, temperature=1.0, top_k=-3)
    with pytest.raises(DFlashInputError, match="needs a draft"):
        spec_generate(target, None, ids)
    # zero new tokens is not an error: the prompt comes back unchanged
    assert torch.equal(spec_generate(target, draft, ids, max_new_tokens=0), ids)


def test_all_errors_share_a_base_class():
    assert issubclass(DFlashConfigError, DFlashError) and issubclass(DFlashInputError, DFlashError)
    assert issubclass(DFlashError, ValueError)


def test_generation_does_not_touch_the_draft_weights(pair):
    target, draft = pair
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    spec_generate(target, draft, *ragged_batch([4, 6]), max_new_tokens=8)
    assert all(torch.equal(before[k], v) for k, v in draft.state_dict().items())
    assert not any(k.startswith(("embed", "lm_head")) for k in draft.state_dict())
