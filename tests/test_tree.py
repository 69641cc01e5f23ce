"""Candidate trees (dflash.tree): the most probable paths through the draft's slot distributions and the text's
n-gram continuation, verified in one forward; the output stays the target's own greedy text."""

import collections
import random

import pytest
import torch

from dflash import DFlashDraftModel, ar_generate, spec_generate
from dflash.batch import read_choices
from dflash.tree import DRAFT, NGRAM, accept, build_trees
from cpu_features import needs_attention_kernel, needs_int4_kernel
from oracle import OracleDraft, SecondChoiceOracle
from test_lossless import MAX_NEW, futures_for, new_tokens, references
from tiny import ARCHS, ragged_batch, tiny_target


def lp(*p):
    return [float(torch.tensor(x).log()) for x in p]


def test_a_tree_holds_the_most_probable_paths_and_the_ngram_branch():
    # slot 1: a 0.6, b 0.3; slot 2: c 0.9, d 0.1; slot 3: e 0.5, f 0.5. Paths by probability: a .6, ac .54,
    # b .3, ace .27 / acf .27, bc .27, ...
    top_ids = [[[10, 11], [12, 13], [14, 15]]]
    top_logp = [[lp(0.6, 0.3), lp(0.9, 0.1), lp(0.5, 0.5)]]
    trees = build_trees([7], top_ids, top_logp, budget=4, continuations=[[11, 20, 21]], device="cpu")
    tokens, parent, depth = (t[0].tolist() for t in (trees.tokens, trees.parent, trees.depth))
    assert tokens[:5] == [7, 10, 12, 11, 14] and parent[:5] == [0, 0, 1, 0, 2] and depth[:5] == [0, 1, 2, 1, 3]
    assert trees.rank[0][:5] == [0, 0, 1, 2, 3]
    # the n-gram continuation b, 20, 21 shares node b with the draft's paths, then branches off
    assert tokens[5:] == [20, 21] and parent[5:] == [3, 5] and trees.source[0][3] == DRAFT | NGRAM
    assert trees.source[0][5] == NGRAM and trees.rank[0][5] == -1
    vis = trees.visible[0]
    assert vis[4].nonzero().flatten().tolist() == [0, 1, 2, 4]  # e sees the anchor, a, c and itself
    assert vis[6].nonzero().flatten().tolist() == [0, 3, 5, 6]


def test_accept_follows_the_targets_choices_down_the_tree():
    trees = build_trees([7], [[[10, 11], [12, 13], [14, 15]]], [[lp(0.6, 0.3), lp(0.9, 0.1), lp(0.5, 0.5)]],
                        budget=6, continuations=None, device="cpu", min_nodes=9)
    tokens = trees.tokens[0].tolist()
    # the target says 11 after the anchor, 12 after 11, 99 after that: the path anchor-11-12 (2 accepted)
    choice = torch.full_like(trees.tokens, 99)
    choice[0, 0] = 11
    choice[0, tokens.index(11)] = 12
    path, accepted = accept(trees, choice, 3)
    assert accepted.tolist() == [2]
    nodes = path[0].tolist()
    assert [tokens[i] for i in nodes[:3]] == [7, 11, 12] and nodes[3] == nodes[2]
    assert choice.gather(1, path)[0, :3].tolist() == [11, 12, 99]  # the committed tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget,topk,ngram", [(6, 2, False), (12, 3, True), (24, 4, True)])
def test_trees_keep_greedy_output_and_accept_second_choices(arch, budget, topk, ngram):
    target = tiny_target(arch, seed=1)
    ids, mask = ragged_batch([3, 11, 6, 9], seed=4)  # as test_lossless: no near-ties on any family
    refs = references(target, ids, mask, MAX_NEW)
    base = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    futures = futures_for(ids, mask, refs)
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], return_stats=True)
    chain = spec_generate(target, SecondChoiceOracle(base, futures, seed=2), ids, mask, **kw)
    tree = spec_generate(target, SecondChoiceOracle(base, futures, seed=2), ids, mask, tree_budget=budget,
                         tree_topk=topk, tree_ngram=ngram, **kw)
    for out in (chain, tree):
        assert new_tokens(out, ids, out.num_new_tokens) == refs, arch
    assert tree.tau > chain.tau + 0.3, (arch, chain.tau, tree.tau)
    assert len(tree.tree_paths) == len(tree.acceptance_lengths)
    assert any(rank > 0 for _, rank, _ in tree.tree_paths)  # paths through a second choice were accepted


def _table_head(choices: torch.Tensor):
    """hidden states that name their node, and a head whose argmax there is `choices` [L, N]; it counts the rows
    it is given"""
    L, N = choices.shape
    hidden = torch.eye(L * N).view(L, N, L * N)
    table = torch.nn.functional.one_hot(choices.reshape(-1), 64).float()
    rows = []

    def head(h):
        rows.append(h.shape[0] * h.shape[1])
        return h @ table
    return hidden, head, rows


def test_reading_the_logits_lazily_gives_the_full_heads_chain_verdict():
    g = torch.Generator().manual_seed(0)
    L, q = 6, 8
    full = torch.randint(0, 64, (L, q), generator=g)  # the target's argmax after every position
    ids = torch.randint(0, 64, (L, q), generator=g)
    for r, n in enumerate([0, 1, 3, 4, 5, 7]):  # row r's drafts 1..n are the target's own tokens
        ids[r, 1:n + 1] = full[r, :n]
    hidden, head, rows = _table_head(full)
    chain = (torch.arange(q) - 1).clamp(min=0).expand(L, q)
    choice = read_choices(head, hidden, ids, chain, None, q - 1, 4)
    accepted = (ids[:, 1:] == choice[:, :-1]).long().cumprod(1).sum(1)
    assert accepted.tolist() == [0, 1, 3, 4, 5, 7]
    for r, n in enumerate(accepted.tolist()):  # what a row commits: its accepted drafts and the target's next
        assert torch.equal(choice[r, :n + 1], full[r, :n + 1])
    assert rows == [L * 4, 3 * 4]  # the rest only for the three rows that got past the first four
    one = read_choices(head, hidden[:1, :4], ids[:1, :4], chain[:1, :4], None, 3, 2)
    assert rows[-1] == 4 and torch.equal(one, full[:1, :4])  # 4 rows cost one row's time: all at once


def test_reading_the_logits_lazily_gives_the_full_heads_tree_verdict():
    rng = random.Random(1)
    L = 5
    top_ids = [[[rng.randrange(64) for _ in range(3)] for _ in range(7)] for _ in range(L)]
    top_logp = [[sorted((-rng.random() * 3 for _ in range(3)), reverse=True) for _ in range(7)] for _ in range(L)]
    trees = build_trees(list(range(L)), top_ids, top_logp, budget=20, continuations=None, device="cpu", min_nodes=8)
    N = trees.size
    g = torch.Generator().manual_seed(2)
    full = torch.randint(0, 64, (L, N), generator=g)
    # each row's target follows the tree down to a node of its own: late nodes too (past the first quarter)
    for r, end in enumerate([0, 2, N // 2, N - 1, N - 3]):
        node = end
        while node != 0:
            up = int(trees.parent[r, node])
            full[r, up] = trees.tokens[r, node]
            node = up
    hidden, head, rows = _table_head(full)
    choice = read_choices(head, hidden, trees.tokens, trees.parent, trees.alive, 7, (N + 3) // 4)
    path, accepted = accept(trees, full, 7)
    lazy_path, lazy_accepted = accept(trees, choice, 7)
    assert torch.equal(lazy_path, path) and torch.equal(lazy_accepted, accepted) and accepted.max() >= 2
    assert torch.equal(choice.gather(1, path), full.gather(1, path))
    assert len(rows) == 2 and rows[0] == L * ((N + 3) // 4) and sum(rows) < L * N  # the rest: some rows only


def test_a_tree_that_is_the_argmax_chain_is_todays_step():
    target = tiny_target("qwen3", seed=1)
    ids, mask = ragged_batch([3, 11, 6, 9], seed=4)
    refs = references(target, ids, mask, MAX_NEW)
    base = DFlashDraftModel.from_target(target, num_layers=1, block_size=6)
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], return_stats=True)
    futures = futures_for(ids, mask, refs)
    chain = spec_generate(target, OracleDraft(base, futures, corrupt=0.3, seed=4), ids, mask, **kw)
    tree = spec_generate(target, OracleDraft(base, futures, corrupt=0.3, seed=4), ids, mask, tree_budget=5,
                         tree_topk=1, tree_ngram=False, **kw)
    assert torch.equal(tree.sequences, chain.sequences)
    assert tree.acceptance_lengths == chain.acceptance_lengths and chain.tau > 2


def test_sampling_verifies_the_chain_as_before():
    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    ids, mask = ragged_batch([4, 7], seed=5)
    outs = [spec_generate(target, draft, ids, mask, max_new_tokens=16, temperature=0.8,
                          generator=torch.Generator().manual_seed(9), **extra)
            for extra in ({}, {"tree_budget": 10})]
    assert torch.equal(*outs)


@needs_attention_kernel
@needs_int4_kernel
def test_trees_are_bitwise_plain_decoding_in_the_int4_runtime():
    target = tiny_target("llama", seed=4).bfloat16()
    ids, mask = ragged_batch([6, 10], seed=7)
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], runtime="fast-int4")
    ar = ar_generate(target, ids, mask, **kw)
    base = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    refs = [ar[i, ids.shape[1]:].tolist() for i in range(2)]
    futures = futures_for(ids, mask, refs)
    for budget in (12, 40):  # trees of more nodes than a block: the attention kernel still takes every query
        tree = spec_generate(target, SecondChoiceOracle(base, futures, seed=1), ids, mask, tree_budget=budget,
                             tree_topk=3, return_stats=True, **kw)
        assert torch.equal(tree.sequences, ar) and tree.tau > 2


def test_the_budget_controller_grows_trees_where_verifying_is_cheap_and_shrinks_them_where_dear():
    from dflash.adaptive import PLAIN, TREE, TreeBudgetController

    def run(seconds_per_token, steps=300, rows=4):
        ctrl = TreeBudgetController(8, ngram_sizes=[])
        for _ in range(steps):
            o = ctrl.choose(rows)
            gain = {0: 0, 2: 0.5, 4: 0.8, 8: 1.0, 16: 1.6, 32: 2.0}[o[1]]  # bigger trees find a little more
            ctrl.observe([gain] * rows, o, 0.02 + seconds_per_token * rows * (o[1] + 1))
        return max(ctrl.counts, key=ctrl.counts.get)
    assert run(0.0) == (TREE, 32)  # verifying is free: the biggest tree
    assert run(0.01) == (PLAIN, 0)  # every verified token costs half a plain step: plain decoding


def test_the_budget_controller_checks_the_texts_continuation_where_the_match_is_long():
    """Where the draft does not pay for its forward but the text repeats, a long n-gram match is worth a chain
    of its continuation and a short one (or none) is not: the choice follows the match, step by step."""
    from dflash.adaptive import NGRAM as CHAIN, PLAIN, TREE, TreeBudgetController

    rng = random.Random(0)
    ctrl = TreeBudgetController(8)
    chosen = {}
    for _ in range(3000):
        match = rng.choice([0, 1, 6])
        o = ctrl.choose(1, [match])
        chosen.setdefault(match, []).append(o)
        w = o[1] + 1
        # a chain after a 6-token match is right 3 tokens deep, after a 1-token one never; the draft adds
        # little; verifying w tokens costs 0.6 + 0.1 w plain steps' worth, and the draft's forward 0.5 more
        accepted = (min(3, o[1]) if match == 6 else 0) if o[0] == CHAIN else (0.2 if o[0] == TREE else 0)
        ctrl.observe([accepted], o, 0.01 * (0.6 + 0.1 * w + 0.5 * (o[0] == TREE)), [match])
    late = {m: collections.Counter(c[-300:]) for m, c in chosen.items()}
    assert late[0].most_common(1)[0][0] == (PLAIN, 0)
    assert late[1].most_common(1)[0][0] == (PLAIN, 0)
    assert late[6].most_common(1)[0][0] == (CHAIN, 3)
    assert (CHAIN, 1) not in late[0]  # nothing found: no chain to check


def test_an_adaptive_tree_keeps_greedy_output():
    target = tiny_target("llama", seed=1)
    ids, mask = ragged_batch([3, 11, 6, 9], seed=4)
    refs = references(target, ids, mask, MAX_NEW)
    base = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    out = spec_generate(target, SecondChoiceOracle(base, futures_for(ids, mask, refs), seed=2), ids, mask,
                        max_new_tokens=MAX_NEW, stop_token_ids=[], tree_budget="auto", return_stats=True)
    assert new_tokens(out, ids, out.num_new_tokens) == refs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_step_option_of_an_adaptive_run_keeps_greedy_output(arch, monkeypatch):
    """Plain steps, n-gram chains of every size (no draft forward, the draft cache catching up afterwards)
    and trees, mixed in one run of ragged rows: the output is still the target's greedy text, and n-gram chains
    did get tokens accepted (a random target over 12 tokens repeats itself)."""
    from dflash.adaptive import NGRAM as CHAIN, TreeBudgetController

    target = tiny_target(arch, seed=1, vocab=12)
    ids, mask = ragged_batch([3, 11, 6, 9], vocab=12, seed=4)
    refs = references(target, ids, mask, MAX_NEW)
    base = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    options = TreeBudgetController(4).options
    assert {k for k, _ in options} == {"plain", CHAIN, "tree"}
    turn = iter(range(10 ** 6))

    def cycle(self, rows, matches=None):
        o = options[next(turn) % len(options)]
        self.counts[o] += 1
        return o if o[0] != CHAIN or any(matches) else ("plain", 0)
    monkeypatch.setattr(TreeBudgetController, "choose", cycle)
    out = spec_generate(target, SecondChoiceOracle(base, futures_for(ids, mask, refs), seed=2), ids, mask,
                        max_new_tokens=MAX_NEW, stop_token_ids=[], tree_budget="auto", return_stats=True)
    assert new_tokens(out, ids, out.num_new_tokens) == refs
    assert any(acc > 0 and rank == -1 and source == NGRAM for acc, rank, source in out.tree_paths)
    assert set(out.step_choices) == {"plain", "ngram-1", "ngram-3", "tree-2", "tree-4", "tree-8", "tree-16"}
    assert sum(out.step_choices.values()) == out.num_steps
