"""`dflash average`: the weighted mean of drafts' weights, and the drafts it refuses."""

import json

import pytest
import torch

from dflash import DFlashConfigError, DFlashDraftModel, ar_generate, spec_generate
from dflash.average import average_drafts
from dflash.cli import main as cli_main
from dflash.errors import DFlashInputError
from tiny import ragged_batch, tiny_target


def drafts(tmp_path, target, n=2, vocab=None, **kw):
    folders = []
    for i in range(n):
        torch.manual_seed(10 + i)
        d = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, **kw)
        if vocab is not None:
            d.set_draft_vocab(vocab)
        d.save_pretrained(tmp_path / f"d{i}")
        folders.append(tmp_path / f"d{i}")
    return folders


def test_weighted_mean_loads_and_decodes_losslessly(tmp_path):
    target = tiny_target("qwen3", seed=1)
    folders = drafts(tmp_path, target, n=3, vocab=list(range(3, 50)))
    record = average_drafts(folders, tmp_path / "avg", weights=[1, 1, 2])
    assert record["weights"] == [0.25, 0.25, 0.5]
    assert json.loads((tmp_path / "avg" / "average.json").read_text()) == record
    parts = [DFlashDraftModel.from_pretrained(f).state_dict() for f in folders]
    avg = DFlashDraftModel.from_pretrained(tmp_path / "avg", target=target)
    for name, t in avg.state_dict().items():
        if name == "draft_vocab":
            assert t.tolist() == list(range(3, 50))
        else:
            want = (0.25 * parts[0][name].double() + 0.25 * parts[1][name].double() + 0.5 * parts[2][name].double())
            assert torch.equal(t, want.float()), name
    ids, mask = ragged_batch([5, 9], seed=2)
    assert torch.equal(spec_generate(target, avg, ids, mask, max_new_tokens=12, stop_token_ids=[]),
                       ar_generate(target, ids, mask, max_new_tokens=12, stop_token_ids=[]))


def test_averaging_a_draft_with_itself_gives_it_back_and_bf16_on_request(tmp_path):
    target = tiny_target("llama", seed=1)
    (folder,) = drafts(tmp_path, target, n=1)
    assert cli_main(["average", str(folder), str(folder), "-o", str(tmp_path / "same")]) == 0
    a, b = (DFlashDraftModel.from_pretrained(f).state_dict() for f in (folder, tmp_path / "same"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert cli_main(["average", str(folder), str(folder), "-o", str(tmp_path / "half"),
                     "--save-dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == "bfloat16"
    assert DFlashDraftModel.from_pretrained(tmp_path / "half").fc.weight.dtype == torch.bfloat16


def test_drafts_that_differ_are_refused_by_name(tmp_path, capsys):
    target = tiny_target("llama", seed=1)
    a, b = drafts(tmp_path / "x", target)
    (deeper,) = drafts(tmp_path / "y", target, n=1, target_layer_ids=[0, 1, 3])
    with pytest.raises(DFlashConfigError, match="target_layer_ids"):
        average_drafts([a, deeper], tmp_path / "out")
    v1, = drafts(tmp_path / "v1", target, n=1, vocab=list(range(3, 40)))
    v2, = drafts(tmp_path / "v2", target, n=1, vocab=list(range(4, 41)))
    with pytest.raises(DFlashConfigError, match="draft_vocab differs"):
        average_drafts([v1, v2], tmp_path / "out")
    with pytest.raises(DFlashConfigError, match="other tensors"):
        average_drafts([a, v1], tmp_path / "out")
    with pytest.raises(DFlashInputError, match="one of the drafts"):
        average_drafts([a, b], a)
    with pytest.raises(DFlashInputError, match="positive"):
        average_drafts([a, b], tmp_path / "out", weights=[1, 0])
    with pytest.raises(DFlashInputError, match="2 weights for 3 drafts"):
        average_drafts([a, b, a], tmp_path / "out", weights=[1, 1])
    assert not (tmp_path / "out").exists()  # nothing written for a refused average
    assert cli_main(["average", str(a), "-o", str(tmp_path / "out")]) == 2
    assert "at least two drafts" in capsys.readouterr().err
