"""Chat-template options (e.g. Qwen3's enable_thinking) reach the template from every entry point: a draft is
accepted well only when prompts are written in the mode its training answers were."""

import copy
import subprocess
import sys

import pytest

from dflash.engine import LLMEngine
from dflash.errors import DFlashError
from dflash.prompts import encode_prompt, parse_template_kwargs
from dflash.regenerate import RegenerateConfig, regenerate
from structured import make_tokenizer, trained_target
from test_server import Served

# the user's words, then "t0" where thinking is switched off (as Qwen3's template adds an empty think block)
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}t0 {% endif %}")


@pytest.fixture(scope="module")
def templated():
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    return trained_target(seed=0), tok


def test_options_change_the_prompt_and_bad_ones_are_named(templated):
    _, tok = templated
    msgs = [{"role": "user", "content": "t3 t5"}]
    plain, off = encode_prompt(tok, msgs), encode_prompt(tok, msgs, None, {"enable_thinking": False})
    assert off == plain + [0]
    assert parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_template_kwargs(None) is None
    for bad, message in (("{enable_thinking: false}", "is not JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(DFlashError, match=message):
            parse_template_kwargs(bad)


def test_regenerate_writes_prompts_with_the_options_and_keeps_them_in_its_settings(templated, tmp_path):
    target, tok = templated
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t3 t5 t7"}\n')
    cfg = dict(sources=[str(prompts)], model="structured", max_new_tokens=4, batch_size=1)
    regenerate(RegenerateConfig(output=str(tmp_path / "off"), chat_template_kwargs={"enable_thinking": False}, **cfg),
               target=target, tokenizer=tok, progress=False)
    record = __import__("json").loads(next((tmp_path / "off").glob("shard-*")).read_text())
    assert record["input_ids"][:record["num_prompt_tokens"]] == [3, 5, 7, 0]
    with pytest.raises(DFlashError, match="other settings"):  # resuming in the other mode would mix modes
        regenerate(RegenerateConfig(output=str(tmp_path / "off"), **cfg), target=target, tokenizer=tok, progress=False)


def test_the_server_applies_its_options_and_a_request_overrides_them(templated):
    target, tok = templated
    served = Served(LLMEngine(copy.deepcopy(target), tok), chat_template_kwargs={"enable_thinking": False})
    try:
        def prompt_tokens(**extra):
            r = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t3 t5"}],
                                                      max_tokens=1, temperature=0, **extra)
            return r.usage.prompt_tokens
        assert prompt_tokens() == 3  # the server's default: thinking off
        assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == 2
    finally:
        served.close()


def test_a_bad_option_on_the_command_line_is_one_clear_error():
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "generate", "hi", "--chat-template-kwargs", "thinking"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("dflash: error: --chat-template-kwargs is not JSON")
