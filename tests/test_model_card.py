"""scripts/model_card.py: a draft's card is built from its runs' records, over sittings and stages."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "model_card.py"


def _run_folder(path: Path, *, sittings: list[list[tuple[int, float]]], tau: float, **cfg) -> str:
    """A `dflash train` output folder: train_config.json, log.jsonl (a clock per sitting), final/config.json."""
    (path / "final").mkdir(parents=True)
    config = {"target": "tiny", "method": "eagle3", "block_size": 7, "ttt_steps": None, "num_anchors": 4, "lr": 1e-3,
              "epochs": 1, "total_steps": 30, "max_length": 64, "train_records": 9, "eval_records": 1,
              "target_layer_ids": [1, 2, 3], "draft_vocab_size": 16, "dtype": "bfloat16", "threads": 2,
              "device": None, "mask_token_id": 0, "gamma": 3.0, **cfg}
    (path / "train_config.json").write_text(json.dumps(config))
    log = [{"step": step, "loss": 5.0 - step / 10, "seconds": seconds} for sitting in sittings for step, seconds in sitting]
    log.append({"step": log[-1]["step"], "eval_tau": tau})
    (path / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (path / "final" / "config.json").write_text(json.dumps(
        {"draft_method": "eagle3", "block_size": 7, "num_hidden_layers": 1, "vocab_size": 64}))
    return str(path)


def _inputs(tmp: Path) -> dict:
    data, bench = tmp / "data", tmp / "bench"
    data.mkdir()
    bench.mkdir()
    (data / "manifest.json").write_text(json.dumps(
        {"settings": {"temperature": 0.0, "max_new_tokens": 32, "sources": ["gsm8k:train", "/home/me/self-prompts"]}}))
    (data / "shard-00000.jsonl").write_text(
        json.dumps({"loss_mask": [0, 1, 1]}) + "\n" + json.dumps({"loss_mask": [0, 0, 1, 1, 1]}) + "\n")
    (bench / "table.txt").write_text("dflash bench: the header\ndataset method\n{\"json\": 1}\n")
    return {"data": data, "bench": bench}


def _card(*args) -> str:
    out = Path(args[args.index("--out") + 1])
    subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], check=True, capture_output=True, text=True)
    return out.read_text()


def test_card_adds_up_sittings_and_stages(tmp_path):
    paths = _inputs(tmp_path)
    # stage 1 ran in two sittings (the clock restarts at 0) and was cut at step 20 for stage 2
    one = _run_folder(tmp_path / "one", sittings=[[(10, 600.0), (20, 1200.0)], [(30, 900.0)]], tau=1.5)
    # stage 2's cosine spans a fixed step count (--schedule-steps), fewer than its 2 epochs' 30
    two = _run_folder(tmp_path / "two", sittings=[[(10, 1800.0)]], tau=1.9, lr=6e-4, epochs=2, schedule_steps=10,
                      total_steps=10)
    card = _card("--train", f"{one}:20", "--train", two, "--data", paths["data"], "--bench", paths["bench"],
                 "--out", tmp_path / "card.md")
    assert "2 answers (5 answer tokens)" in card and "prompt sets gsm8k:train, self-prompts." in card  # no local paths
    assert "Stage 1, from a fresh draft, on 9 answers (1 held out)" in card and "20 optimizer steps, 0.33 h" in card
    assert "Stage 2, from the previous stage" in card and "10 optimizer steps, 0.50 h of wall time on 2 thread(s)" in card
    assert "lr 0.001 (cosine over 1 epoch(s) of 30 steps)" in card and "lr 0.0006 (cosine over 10 steps)" in card
    assert "held-out tau 1.90 (1 held-out training answers)" in card and "In all 30 steps and 0.83 h of training" in card
    assert "dataset method" in card and '{"json"' not in card


def test_card_carries_over_the_stages_of_an_earlier_card(tmp_path):
    paths = _inputs(tmp_path)
    one = _run_folder(tmp_path / "one", sittings=[[(10, 600.0), (20, 1200.0)], [(30, 900.0)]], tau=1.5)
    first = _card("--train", one, "--data", paths["data"], "--bench", paths["bench"], "--out", tmp_path / "first.md")
    assert "In all 30 steps and 0.58 h of training" in first
    # the first stage's folder is gone; the next stage started from the draft that card describes
    two = _run_folder(tmp_path / "two", sittings=[[(40, 3600.0)]], tau=2.0, draft_vocab_size=None)
    import torch
    from safetensors.torch import save_file
    save_file({"draft_vocab": torch.arange(12)}, tmp_path / "two" / "final" / "model.safetensors")
    card = _card("--train", two, "--earlier-card", tmp_path / "first.md", "--data", paths["data"],
                 "--bench", paths["bench"], "--out", tmp_path / "card.md")
    stage1 = next(line for line in first.splitlines() if line.startswith("- Stage 1"))
    assert stage1 in card.splitlines()
    assert "Stage 2, from the previous stage" in card and "held-out tau 2.00" in card
    assert "In all 70 steps and 1.58 h of training" in card
    assert "proposals from the 12 most frequent answer tokens" in card  # the vocabulary it kept, not --draft-vocab-size


def test_an_older_cards_answer_count_moves_into_its_first_stage(tmp_path):
    paths = _inputs(tmp_path)
    # a card written before the stage lines named their answers: its data section did, for its first stage
    (tmp_path / "old.md").write_text(
        "## Data\n- Training splits and prompt sets only. Training used 18372 of them and held out 8.\n\n"
        "## Training\n- Stage 1, from a fresh draft: block size 8, 4592 optimizer steps, 1.88 h of wall time.\n"
        "- In all 4592 steps and 1.88 h of training (target dtype auto, 2 threads, cpu).\n")
    two = _run_folder(tmp_path / "two", sittings=[[(40, 3600.0)]], tau=2.0)
    card = _card("--train", two, "--earlier-card", tmp_path / "old.md", "--data", paths["data"],
                 "--bench", paths["bench"], "--out", tmp_path / "card.md")
    assert card.splitlines()[card.splitlines().index("## Training") + 1] == (
        "- Stage 1, from a fresh draft, on 18372 answers (8 held out): block size 8, 4592 optimizer steps, 1.88 h of "
        "wall time on 2 thread(s).")
    assert "Stage 2, from the previous stage, on 9 answers (1 held out)" in card


def _ablation(path: Path, *runs: tuple[str, float], mlp: int = 64) -> Path:
    path.write_text(json.dumps([
        {"run": run, "data": 9, "depth": 1, "kv": 3, "mlp": mlp, "block": 8, "gamma": 3.27, "anchors": 32, "start": "fresh",
         "lr": 6e-4, "hours": 1.0, "steps": 40, "tau": {"gsm8k": tau}, "mean_tau": tau, "evaluation": "evaluate 40×128"}
        for run, tau in runs]))
    return path


def test_a_later_stage_keeps_the_earlier_cards_recipe_comparison(tmp_path):
    paths = _inputs(tmp_path)
    one = _run_folder(tmp_path / "one", sittings=[[(30, 900.0)]], tau=1.5)
    first = _card("--train", one, "--data", paths["data"], "--bench", paths["bench"], "--ablation",
                  _ablation(tmp_path / "a1.json", ("r0", 1.5), ("r1", 1.7)), "--out", tmp_path / "first.md")
    two = _run_folder(tmp_path / "two", sittings=[[(40, 3600.0)]], tau=2.0)
    # the runs behind r0 and r1 are gone; the new comparison repeats r1 and adds s2
    card = _card("--train", two, "--earlier-card", tmp_path / "first.md", "--data", paths["data"], "--bench",
                 paths["bench"], "--ablation", _ablation(tmp_path / "a2.json", ("r1", 1.7), ("s2", 2.0)),
                 "--out", tmp_path / "card.md")
    def runs(text):
        return [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "| dflash |" in line]

    assert runs(card) == ["r0", "r1", "s2"]
    assert card.count("## Recipe comparison") == 1 and card.index("## Recipe comparison") < card.index("## Benchmark")
    # without a new comparison the earlier one is kept as it was
    kept = _card("--train", two, "--earlier-card", tmp_path / "first.md", "--data", paths["data"], "--bench",
                 paths["bench"], "--out", tmp_path / "kept.md")
    assert runs(kept) == runs(first) == ["r0", "r1"]
    # a carried row's start set by hand: the folder it names held another draft then
    renamed = _card("--train", two, "--earlier-card", tmp_path / "first.md", "--data", paths["data"], "--bench",
                    paths["bench"], "--start-of", "r1=r0", "--out", tmp_path / "renamed.md")
    assert column(renamed, "start") == {"r0": "fresh", "r1": "r0"}
    bad = subprocess.run([sys.executable, str(SCRIPT), "--train", two, "--earlier-card", tmp_path / "first.md",
                          "--data", paths["data"], "--bench", paths["bench"], "--start-of", "r9=r0", "--out",
                          tmp_path / "bad.md"], capture_output=True, text=True)
    assert bad.returncode != 0 and "no run ['r9']" in bad.stderr

    # a card made before the table had a column: its rows get that column empty, the new rows their own value
    lines = first.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("| run |")))
    drop = [c.strip() for c in lines[head].split("|")].index("mlp units")
    for i in range(head, head + 4):
        cells = lines[i].split("|")
        lines[i] = "|".join(cells[:drop] + cells[drop + 1:])
    (tmp_path / "older.md").write_text("\n".join(lines) + "\n")
    merged = _card("--train", two, "--earlier-card", tmp_path / "older.md", "--data", paths["data"], "--bench",
                   paths["bench"], "--ablation", _ablation(tmp_path / "a3.json", ("s2", 2.0), mlp=3072),
                   "--out", tmp_path / "merged.md")
    assert column(merged, "mlp units") == {"r0": "", "r1": "", "s2": "3072"}
    assert column(merged, "start") == {"r0": "fresh", "r1": "fresh", "s2": "fresh"}
    # one the new table lacks cannot be filled in
    (tmp_path / "newer.md").write_text(first.replace("| run |", "| run | colour |").replace("| r0 |", "| r0 | red |")
                                       .replace("| r1 |", "| r1 | red |").replace("|---|", "|---|---|", 1))
    bad = subprocess.run([sys.executable, str(SCRIPT), "--train", two, "--earlier-card", tmp_path / "newer.md",
                          "--data", paths["data"], "--bench", paths["bench"], "--ablation", tmp_path / "a3.json",
                          "--out", tmp_path / "bad.md"], capture_output=True, text=True)
    assert bad.returncode != 0 and "columns this one lacks: ['colour']" in bad.stderr


def column(card: str, name: str) -> dict[str, str]:
    """One column of a card's recipe comparison, by run."""
    lines = card.splitlines()
    head = next(line for line in lines if line.startswith("| run |"))
    col = [c.strip() for c in head.split("|")].index(name)
    return {line.split("|")[1].strip(): line.split("|")[col].strip() for line in lines
            if line.startswith("| ") and "| dflash |" in line}


def test_card_with_packed_data_the_held_out_evaluation_and_the_recipe_comparison(tmp_path):
    import torch
    from safetensors.torch import save_file

    paths = _inputs(tmp_path)
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "manifest.json").write_text(json.dumps(
        {"settings": {"temperature": 0.8, "max_new_tokens": 64, "sources": ["self:100"]}}))
    save_file({"answer_offsets": torch.tensor([0, 4, 9])}, str(packed / "packed-000000-000002.safetensors"),
              metadata={"records": json.dumps([["self:0", "stop"], ["self:1", "length"]])})
    evaluate = tmp_path / "eval"
    evaluate.mkdir()
    (evaluate / "results.json").write_text(json.dumps({
        "block_size": 3, "hardware": "a CPU", "config": {"num_prompts": 40, "max_new_tokens": 128},
        "datasets": {"gsm8k": {"tau": 2.5, "slot_acceptance": [0.9, 0.7], "steps": 50}}}))
    (evaluate / "slot_acceptance.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "ablation.json").write_text(json.dumps([
        {"run": "r0", "data": 9, "depth": 1, "kv": 3, "block": 8, "gamma": 3.27, "anchors": 512, "start": "fresh", "lr": 6e-4,
         "hours": 2.0, "steps": 40, "tau": {"gsm8k": 2.1}, "mean_tau": 2.1,
         "evaluation": "evaluate 40×128, block 8"}]))
    run = _run_folder(tmp_path / "run", sittings=[[(10, 3600.0)]], tau=2.0, method="dflash",
                      schedule={"total_steps": 99, "max_hours": 1.0})
    with open(tmp_path / "run" / "log.jsonl", "a") as f:  # the size a time budget chose, not the epochs' count
        f.write(json.dumps({"step": 2, "calibrated_total_steps": 30, "seconds_per_step": 120.0}) + "\n")
    saved = tmp_path / "run" / "final" / "config.json"  # a DFlash draft whose MLPs are not the target's width
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "draft_method": "dflash", "intermediate_size": 96}))
    card_path = tmp_path / "card" / "README.md"
    card_path.parent.mkdir()
    card = _card("--train", run, "--data", paths["data"], "--data", packed, "--bench", paths["bench"],
                 "--evaluate", evaluate, "--ablation", tmp_path / "ablation.json", "--out", card_path)
    assert "`packed`: 2 answers (9 answer tokens)" in card and "In all 4 answers (14 answer tokens)" in card
    assert "cosine over 30 steps, a 1.0 h budget" in card
    assert "- 1 draft layer(s) of 96 MLP units, block size 7, mask token 0, target layers [1, 2, 3]" in card
    assert "| gsm8k | 2.50 | 0.90 | 0.70 | 50 |" in card and (card_path.parent / "slot_acceptance.png").is_file()
    # a table from before the drafter, sequences/step, distill, step and MLP columns reads as the defaults it ran
    # with (the MLP's: the target's, left empty)
    assert ("| r0 | dflash | 9 | 1 | 3 |  | 8 | 3.27 | 512 | 1 | 0.0 | fresh | 0.0006 | live | 2.0 | 40 | 2.10 | 2.10 | "
            "evaluate 40×128, block 8 |") in card


def _evaluation(folder: Path, taus: dict, num_prompts: int = 40, per_prompt: bool = False) -> Path:
    folder.mkdir()
    sets = {name: {"tau": tau, "slot_acceptance": [0.5], "steps": 10} for name, tau in taus.items()}
    if per_prompt:  # prompts alike (10 steps each): the ratio's interval is the ratio
        for r in sets.values():
            r["per_prompt"] = [[10, round(10 * r["tau"])]] * 4
    (folder / "results.json").write_text(json.dumps({
        "block_size": 8, "hardware": "a CPU", "config": {"num_prompts": num_prompts, "max_new_tokens": 128},
        "datasets": sets, "mean_tau": sum(taus.values()) / len(taus)}))
    (folder / "slot_acceptance.png").write_bytes(b"\x89PNG fake")
    return folder


def test_the_peers_card_sets_the_dflash_drafts_evaluation_beside_its_own(tmp_path):
    paths = _inputs(tmp_path)
    run = _run_folder(tmp_path / "peer", sittings=[[(30, 900.0)]], tau=1.5)
    ours = _evaluation(tmp_path / "ours", {"gsm8k": 2.0, "mbpp": 1.6})
    dflash = _evaluation(tmp_path / "dflash", {"gsm8k": 2.6, "mbpp": 2.4, "mt-bench": 2.0})
    card = _card("--train", run, "--data", paths["data"], "--bench", paths["bench"], "--evaluate", ours,
                 "--versus", f"DFlash={dflash}", "--out", tmp_path / "card.md")
    assert "## Against DFlash (the same evaluation)" in card
    assert "| gsm8k | 2.00 | 2.60 | 1.30x |" in card and "| mbpp | 1.60 | 2.40 | 1.50x |" in card
    assert "mt-bench" not in card  # only the sets this draft was evaluated on
    assert "95% interval" not in card  # evaluations without per-prompt counts
    # with them, the ratio's interval over the prompts
    both = [_evaluation(tmp_path / f"{name}-pp", taus, per_prompt=True)
            for name, taus in (("ours", {"gsm8k": 2.0, "mbpp": 1.6}), ("dflash", {"gsm8k": 2.6, "mbpp": 2.4}))]
    card = _card("--train", run, "--data", paths["data"], "--bench", paths["bench"], "--evaluate", both[0],
                 "--versus", f"DFlash={both[1]}", "--out", tmp_path / "card-pp.md")
    assert "| gsm8k | 2.00 | 2.60 | 1.30x | 1.30-1.30x |" in card
    assert "| mbpp | 1.60 | 2.40 | 1.50x | 1.50-1.50x |" in card
    # another evaluation (fewer prompts, a set missing) is not comparable: an error naming the difference
    for other, words in ((_evaluation(tmp_path / "short", {"gsm8k": 2.6, "mbpp": 2.4}, 20), "num_prompts=20"),
                         (_evaluation(tmp_path / "part", {"gsm8k": 2.6}), "lacks mbpp")):
        out = subprocess.run([sys.executable, str(SCRIPT), "--train", run, "--data", str(paths["data"]), "--bench",
                              str(paths["bench"]), "--evaluate", str(ours), "--versus", f"DFlash={other}", "--out",
                              str(tmp_path / "bad.md")], capture_output=True, text=True)
        assert out.returncode != 0 and words in out.stderr


def test_a_card_of_the_same_draft_measured_again_keeps_its_draft_and_training(tmp_path):
    import shutil

    paths = _inputs(tmp_path)
    run = _run_folder(tmp_path / "peer", sittings=[[(30, 900.0)]], tau=1.5)
    first = _card("--train", run, "--data", paths["data"], "--bench", paths["bench"], "--evaluate",
                  _evaluation(tmp_path / "ours", {"gsm8k": 2.0}), "--versus",
                  f"DFlash={_evaluation(tmp_path / 'dflash', {'gsm8k': 2.6})}", "--out", tmp_path / "first.md")
    shutil.rmtree(run)  # the peer's run is gone (another machine); a newer DFlash draft is to be set beside it
    again = _evaluation(tmp_path / "again", {"gsm8k": 2.0}, per_prompt=True)
    newer = _evaluation(tmp_path / "newer", {"gsm8k": 3.0}, per_prompt=True)
    card = _card("--earlier-card", tmp_path / "first.md", "--data", paths["data"], "--evaluate", again,
                 "--versus", f"the newer DFlash draft={newer}", "--out", tmp_path / "card.md")

    def part(text, title):  # a section with its heading, up to the next one
        return text[text.index(title):text.index("\n## ", text.index(title))]

    assert "| gsm8k | 2.00 | 3.00 | 1.50x | 1.50-1.50x |" in card and "## Against DFlash (" not in card
    assert card.splitlines()[0] == first.splitlines()[0] == "# EAGLE-3-style drafter (the bench's peer) for tiny"
    for title in ("## Draft", "## Training"):
        assert part(card + "\n## ", title) == part(first + "\n## ", title)
    # the carried benchmark says so, once however often the card is made again
    carried = part(first + "\n## ", "## Benchmark").replace("\n", "\nAs the card before this one had it, run with "
                                                              "the drafts shipped then.\n\n", 1)
    assert part(card + "\n## ", "## Benchmark") == carried
    twice = _card("--earlier-card", tmp_path / "card.md", "--data", paths["data"], "--out", tmp_path / "twice.md")
    assert part(twice + "\n## ", "## Benchmark") == carried
    # a new bench replaces the carried one
    (tmp_path / "bench2").mkdir()
    (tmp_path / "bench2" / "table.txt").write_text("dflash bench: a new header\n")
    card = _card("--earlier-card", tmp_path / "first.md", "--data", paths["data"], "--bench", tmp_path / "bench2",
                 "--out", tmp_path / "card2.md")
    assert "a new header" in card and "dataset method" not in card
    # neither runs nor a card to carry over, a trained draft without its bench, a card without training: errors
    bad = tmp_path / "bad.md"
    bad.write_text("# a card\n\n## Data\n- answers\n")
    for args, words in (((), "--train is needed"), (("--train", run), "--bench is needed with --train"),
                        (("--earlier-card", bad), "no draft and training sections")):
        out = subprocess.run([sys.executable, str(SCRIPT), *map(str, args), "--data", str(paths["data"]),
                              "--out", str(tmp_path / "x.md")], capture_output=True, text=True)
        assert out.returncode != 0 and words in out.stderr


def test_an_averaged_stage_is_its_runs_side_by_side_in_the_card_and_the_comparison(tmp_path):
    paths = _inputs(tmp_path)
    one = _run_folder(tmp_path / "one", sittings=[[(30, 900.0)]], tau=1.5, method="dflash", num_layers=1)
    # two runs from stage 1's draft, other anchors and batches; their finals averaged (dflash average's record)
    a = _run_folder(tmp_path / "a", sittings=[[(20, 1800.0)]], tau=2.0, method="dflash", batch_size=8,
                    num_layers=1, init_draft=f"{one}/final")
    b = _run_folder(tmp_path / "b", sittings=[[(40, 3600.0)]], tau=2.1, method="dflash", num_anchors=8, batch_size=4,
                    num_layers=1, init_draft=f"{one}/final")
    soup = tmp_path / "soup"
    soup.mkdir()
    (soup / "config.json").write_text((tmp_path / "a" / "final" / "config.json").read_text())
    (soup / "average.json").write_text(json.dumps({"drafts": [f"{a}/final", f"{b}/final"], "weights": [0.5, 0.5]}))
    card = _card("--train", one, "--train", soup, "--data", paths["data"], "--bench", paths["bench"],
                 "--out", tmp_path / "card.md")
    line = next(x for x in card.splitlines() if x.startswith("- Stage 2"))
    assert "2 runs side by side, their weights then averaged (`dflash average`, weights 0.50/0.50)" in line
    assert "(a) on 9 answers" in line and "4 anchors per sequence, 8 sequences per step" in line
    assert "(b) on 9 answers" in line and "8 anchors per sequence, 4 sequences per step" in line
    assert "20 optimizer steps, 0.50 h" in line and "40 optimizer steps, 1.00 h" in line
    assert "In all 90 steps and 1.75 h of training" in card  # both runs were paid for
    # what build_eagle3_draft.sh adds up for the peer's equal compute
    runs = subprocess.run([sys.executable, "-c", "import sys; from model_card import runs_of; "
                           "print(runs_of(sys.argv[1]), runs_of(sys.argv[2]))", str(soup), one],
                          cwd=SCRIPT.parent, check=True, capture_output=True, text=True).stdout
    assert runs.strip() == str([a, b]) + " " + str([one])
    cut = subprocess.run([sys.executable, str(SCRIPT), "--train", f"{soup}:10", "--data", paths["data"], "--bench",
                          paths["bench"], "--out", tmp_path / "bad.md"], capture_output=True, text=True)
    assert cut.returncode != 0 and "no steps to cut at" in cut.stderr

    evaluate = _evaluation(tmp_path / "eval", {"gsm8k": 2.4, "mbpp": 2.0})
    table = subprocess.run([sys.executable, str(SCRIPT.parent / "ablation_table.py"), str(one), str(a), str(b),
                            f"{soup}={evaluate}"], check=True, capture_output=True, text=True).stdout
    head, row = (next(x for x in table.splitlines() if x.startswith(f"| {r} ")) for r in ("run", "soup"))
    cells = dict(zip(*([c.strip() for c in x.split("|")[1:-1]] for x in (head, row))))
    assert (cells["anchors"], cells["sequences/step"]) == ("4/8", "8/4")  # a's/b's
    assert cells["start"] == "one" and (cells["hours"], cells["steps"]) == ("1.5", "60")  # hours and steps added up
    assert [cells[k] for k in ("gsm8k", "mbpp", "mean τ", "τ from")] == ["2.40", "2.00", "2.20",
                                                                         "evaluate 40×128, block 8"]
