"""The `dflash` command, run as users run it: in a subprocess, on a tiny GGUF model."""

import io
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dflash import DFlashDraftModel
from dflash.cli import Session, build_parser
from dflash.engine import TextStream
from dflash.loading import load_target


def run(*args, stdin=None, env_home=None, timeout=300):
    env = dict(os.environ)
    if env_home:
        env["DFLASH_HOME"] = str(env_home)
    return subprocess.run([sys.executable, "-m", "dflash.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def setup(tiny_gguf, tmp_path_factory):
    home = tmp_path_factory.mktemp("cli-home")
    model, tok = load_target(tiny_gguf, dtype="float32")
    draft_dir = tmp_path_factory.mktemp("draft")
    DFlashDraftModel.from_target(model, block_size=4, tokenizer=tok).save_pretrained(draft_dir)
    return home, draft_dir


def common(tiny_gguf):
    return ["--model", tiny_gguf, "--dtype", "float32", "--max-new-tokens", "24", "--threads", "1"]


def test_generate_streams_text_and_prints_stats(tiny_gguf, setup):
    home, draft = setup
    spec = run("generate", "hello the", *common(tiny_gguf), "--draft", draft, env_home=home)
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout.strip(), "no text on stdout"
    stats = [line for line in spec.stderr.splitlines() if line.startswith("[dflash]")]
    assert len(stats) == 1 and "tok/s" in stats[0] and "τ=" in stats[0] and "ttft=" in stats[0]
    assert "acceptance [" in stats[0] and "steps per verify width [" in stats[0]  # adaptive by default
    plain = run("generate", "hello the", *common(tiny_gguf), "--no-draft", env_home=home)
    assert plain.returncode == 0 and "no draft" in plain.stderr
    assert plain.stdout == spec.stdout  # greedy: the draft changes the speed, never the text
    fixed = run("generate", "hello the", *common(tiny_gguf), "--draft", draft, "--fixed-width", env_home=home)
    assert fixed.returncode == 0 and "verify width" not in fixed.stderr and fixed.stdout == spec.stdout
    tree = run("generate", "hello the", *common(tiny_gguf), "--draft", draft, "--tree-budget", "auto", env_home=home)
    assert tree.returncode == 0 and tree.stdout == spec.stdout
    assert re.search(r"steps per check plain \d+", tree.stderr), tree.stderr
    lookup = run("generate", "hello the", *common(tiny_gguf), "--draft", draft, "--fixed-width", "--no-prompt-lookup",
                 env_home=home)
    assert lookup.returncode == 0 and lookup.stdout == spec.stdout


def test_sampling_options_and_seed(tiny_gguf, setup):
    home, draft = setup
    args = ["generate", "the", *common(tiny_gguf), "--draft", draft, "--temperature", "0.9", "--top-k", "20",
            "--top-p", "0.9", "--seed", "7", "--block-size", "3", "--system", "be brief"]
    a, b = run(*args, env_home=home), run(*args, env_home=home)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_serve_options_reach_the_engine(tiny_gguf, setup):
    from dflash.cli import _engine

    _, draft = setup
    base = ["serve", "--model", str(tiny_gguf), "--dtype", "float32", "--draft", str(draft), "--threads", "1"]
    lookup = _engine(build_parser().parse_args(base))  # prompt lookup and adaptive widths by default
    plain = _engine(build_parser().parse_args(base + ["--no-prompt-lookup", "--fixed-width", "--max-batch-size", "3"]))
    assert lookup.runner.prompt_lookup is not None and lookup.runner.widths is not None
    assert plain.runner.prompt_lookup is None and plain.runner.widths is None
    assert plain.config.max_batch_size == 3 and plain.block_size == 4
    assert [s.output_ids for s in lookup.generate([[5, 6, 7]], max_tokens=8)] == \
        [s.output_ids for s in plain.generate([[5, 6, 7]], max_tokens=8)]


def test_streaming_writes_piece_by_piece(tiny_gguf, setup):
    _, draft = setup
    args = build_parser().parse_args(["generate", "x", "--model", str(tiny_gguf), "--dtype", "float32",
                                      "--draft", str(draft), "--max-new-tokens", "30"])
    session = Session(args)
    writes = []
    out = SimpleNamespace(write=writes.append, flush=lambda: None)
    session.stop_ids = []  # run to the token budget so there are many steps
    text, result = session.answer([{"role": "user", "content": "the"}], out=out)
    assert result.num_steps > 3
    assert "".join(writes) == text and sum(1 for w in writes if w) > 3


def test_text_stream_holds_back_partial_utf8():
    class Tok:
        table = {1: b"caf", 2: b"\xc3", 3: b"\xa9!"}

        def decode(self, ids, skip_special_tokens=True):
            return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")

    s = TextStream(Tok())
    assert s.push([1]) == "caf"
    assert s.push([2]) == ""  # half of "é": wait for the rest
    assert s.push([3]) == "é!"


def test_chat_keeps_history_and_handles_commands(tiny_gguf, setup):
    home, draft = setup
    r = run("chat", *common(tiny_gguf), "--draft", draft, stdin="hello\nthe\n/reset\nagain\n/exit\nnever\n",
            env_home=home)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[dflash]") == 3 and "history cleared" in r.stderr
    eof = run("chat", *common(tiny_gguf), "--no-draft", stdin="hi\n", env_home=home)  # Ctrl-D ends it
    assert eof.returncode == 0 and eof.stderr.count("[dflash]") == 1


def test_chat_ctrl_c_cancels_only_the_answer(tiny_gguf, setup, monkeypatch, capsys):
    """Ctrl-C while answering drops that turn; the session goes on to the next line."""
    from dflash import cli

    _, draft = setup
    lines = iter(["first", "second", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    calls = []
    real = cli.Session.answer

    def answer(self, messages, out=sys.stdout):
        calls.append([m["content"] for m in messages])
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, messages, out=io.StringIO())

    monkeypatch.setattr(cli.Session, "answer", answer)
    code = cli.main(["chat", "--model", str(tiny_gguf), "--dtype", "float32", "--draft", str(draft),
                     "--max-new-tokens", "5"])
    assert code == 0
    assert calls == [["first"], ["second"]]  # the cancelled turn is not in the history
    assert "answer cancelled" in capsys.readouterr().err


@pytest.mark.parametrize("bad,needle", [
    (["--max-new-tokens", "-1"], "must be >= 0"),
    (["--top-p", "0"], "must be in (0"),
    (["--temperature", "hot"], "expected a number"),
    (["--block-size", "1"], "must be >= 2"),
    (["--model", "./does/not/exist"], "path does not exist"),
    (["--model", "no-such-alias"], "unknown model 'no-such-alias'"),
    (["--draft", "./nope", "--no-draft"], "not allowed with argument"),
])
def test_bad_input_exits_nonzero_with_one_line(tiny_gguf, setup, bad, needle):
    home, _ = setup
    r = run("generate", "hi", "--max-new-tokens", "4", *bad, env_home=home)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_help_shows_defaults():
    for cmd in (["--help"], ["generate", "--help"], ["chat", "--help"]):
        r = run(*cmd)
        assert r.returncode == 0
        if cmd[0] != "--help":
            assert "(default: 256)" in r.stdout and "(default: smollm2-135m-instruct)" in r.stdout


def test_bench_serve_runs_dflash_and_ar_servers(tiny_gguf, setup, tmp_path):
    import json

    home, draft = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello the", "the cat", "a b c"]) + "\n")
    out = tmp_path / "bs"
    r = run("bench-serve", "--model", tiny_gguf, "--draft", draft, "--dtype", "float32", "--threads", "1",
            "--prompts", prompts, "--concurrency", "1,3", "--num-prompts", "3", "--max-tokens", "12", "--out", out,
            env_home=home)
    assert r.returncode == 0, r.stderr + r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(summary["throughput_ratio"]) == {"1", "3"} and summary["greedy_mismatches"] == 0
    # the three prompts answered alone, then three at once: the same answers
    assert summary["differences_from_solo"] == {m: {"compared": 3, "differing": 0} for m in ("dflash", "ar")}
    report = json.loads((out / "results.json").read_text())
    assert [row["concurrency"] for row in report["results"]["dflash"]] == [1, 3]
    assert all(row["tokens"] > 0 and row["ttft_p50_s"] > 0 for rows in report["results"].values() for row in rows)
    assert (out / "pareto.png").stat().st_size > 0


def test_bench_serve_compares_answers_under_concurrency_with_answers_alone():
    from dflash.bench_serve import differences_from_solo

    rows = [{"concurrency": 1, "texts": ["a", "b"]}, {"concurrency": 4, "texts": ["a", "b", "a", "x"]}]
    assert differences_from_solo(rows, 2) == {"compared": 4, "differing": 1}
    assert differences_from_solo(rows[1:], 2) == {"compared": 0, "differing": 0}  # nothing alone to compare with


def test_bench_serve_tells_near_ties_from_unexplained_differences(tiny_gguf):
    import argparse

    from dflash.bench_serve import classify_mismatches
    from dflash.prompts import Prompt

    args = argparse.Namespace(model=tiny_gguf, dtype="float32", device=None, threads=1, runtime="auto")
    _, tok = load_target(tiny_gguf, dtype="float32")
    prompt = Prompt("p:1", [{"role": "user", "content": "the cat"}])
    ar_text, spec_text = "the cat sat on", "the cat dog on"
    row = {"concurrency": 1}
    same = {"dflash": [dict(row, texts=[ar_text])], "ar": [dict(row, texts=[ar_text])]}
    assert classify_mismatches(args, [prompt], same) == []
    found = classify_mismatches(args, [prompt], {"dflash": [dict(row, texts=[spec_text])],
                                                 "ar": [dict(row, texts=[ar_text])]})
    part = len(tok("the cat", add_special_tokens=False)["input_ids"])
    # two different tokens of a random fp32 model: their logits are far apart next to fp32 rounding
    assert len(found) == 1 and found[0]["token"] >= part - 1 and not found[0]["near_tie"]
    assert abs(found[0]["logit_gap"]) > 0
