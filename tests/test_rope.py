import pytest
import torch

from dflash.rope import _signed, rope_tables
from tiny import tiny_config


def _rotary(arch="llama", **rope):
    import transformers as tf

    cfg = tiny_config(arch)
    if rope:
        cfg.rope_parameters = {"rope_theta": 10000.0, **rope}
    model_cls = {"llama": tf.models.llama.modeling_llama.LlamaRotaryEmbedding,
                 "qwen3": tf.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding}[arch]
    return model_cls(cfg)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_from_the_table_is_what_the_rotary_module_computes(arch, dtype):
    # the table is the module's own cos/sin: the same bits for any positions, batch shape and dtype, and when a
    # position past the table makes it grow
    rotary = _rotary(arch)
    x = torch.zeros(3, 5, 16, dtype=dtype)
    for positions in (torch.tensor([[7]]), torch.randint(0, 900, (3, 5)), torch.arange(2000, 2005)[None],
                      torch.randint(0, 3000, (2, 9))):
        got = rope_tables(rotary, x[:positions.shape[0], :positions.shape[1]], positions)
        want = _signed(*rotary(x[:positions.shape[0], :positions.shape[1]], positions))
        for g, w in zip(got, want):
            assert g.dtype == dtype and torch.equal(g, w)
    assert next(iter(rotary._dflash_rope_tables.values()))[0].shape[0] >= 3000


def test_the_negated_half_makes_rotate_half_in_one_roll():
    rotary = _rotary()
    x = torch.randn(2, 4, 16)  # one head
    positions = torch.randint(0, 100, (2, 4))
    cos, sin = rotary(x, positions)
    half = x.shape[-1] // 2
    hf = x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin
    cos_t, sin_t = rope_tables(rotary, x, positions)
    assert torch.equal(x * cos_t + x.roll(half, -1) * sin_t, hf)


def test_a_new_frequency_or_a_dynamic_rope_is_not_read_from_an_old_table():
    rotary = _rotary()
    x, positions = torch.zeros(1, 3, 16), torch.tensor([[5, 6, 300]])
    rope_tables(rotary, x, positions)
    rotary.inv_freq.mul_(0.5)  # written in place: a new version
    assert torch.equal(rope_tables(rotary, x, positions)[1], _signed(*rotary(x, positions))[1])
    rotary.inv_freq = rotary.inv_freq * 3  # replaced
    assert torch.equal(rope_tables(rotary, x, positions)[1], _signed(*rotary(x, positions))[1])
    assert len(rotary._dflash_rope_tables) == 1
    dynamic = _rotary(rope_type="dynamic", factor=2.0)
    rope_tables(dynamic, x, positions)  # computed by the module: its frequencies follow the sequence
    assert not hasattr(dynamic, "_dflash_rope_tables")
    # a negative position (never a real one) is the module's too
    negative = torch.tensor([[-1, 0, 1]])
    assert torch.equal(rope_tables(rotary, x, negative)[0], _signed(*rotary(x, negative))[0])
