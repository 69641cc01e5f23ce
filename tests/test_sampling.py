"""Sampling is lossless: speculative and plain sampling both match the target's exact distribution."""

import itertools
import math

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash import DFlashDraftModel, ar_generate, spec_generate
from oracle import OracleDraft
from tiny import ragged_batch, reference_greedy, tiny_target

V = 8  # small vocabulary: the joint law of 3 tokens has 512 outcomes, few enough to estimate
N = 12000
STEPS = 3


def exact_joint(target, prompt, temperature, top_k, top_p):
    """P(x1, x2, x3 | prompt) after HF's own temperature/top-k/top-p warpers, by enumeration."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))

    def dist(prefixes):
        logits = target(torch.stack(prefixes)).logits[:, -1]
        return warpers(torch.stack(prefixes), logits).softmax(-1).double()

    probs = {}
    with torch.no_grad():
        p1 = dist([prompt])[0]
        pre2 = [torch.cat([prompt, torch.tensor([a])]) for a in range(V)]
        p2 = dist(pre2)
        pre3 = [torch.cat([prompt, torch.tensor([a, b])]) for a, b in itertools.product(range(V), repeat=2)]
        p3 = dist(pre3).view(V, V, V)
    for a, b, c in itertools.product(range(V), repeat=3):
        probs[(a, b, c)] = float(p1[a] * p2[a, b] * p3[a, b, c])
    return probs


def chi_square_z(counts: dict, probs: dict, n: int) -> float:
    """Chi-square statistic over outcomes with expected count >= 5 (the rest pooled), as a Wilson-Hilferty z."""
    stat, dof, rest_obs, rest_exp = 0.0, 0, 0, 0.0
    for key, p in probs.items():
        e, o = p * n, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            dof += 1
        else:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
        dof += 1
    k = dof - 1
    return ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def every_pair() -> torch.Tensor:
    """A de Bruijn sequence of order 2 over the V tokens, wrapped: every pair of tokens occurs in it."""
    seq, seen, t = [0], set(), 0
    while len(seen) < V * V:
        t = next(u for u in reversed(range(V)) if (t, u) not in seen)  # prefer-largest greedy construction
        seen.add((seq[-1], t))
        seq.append(t)
    return torch.tensor(seq)


def sample_counts(fn, prompt, seed):
    counts = {}
    g = torch.Generator().manual_seed(seed)
    for _ in range(N // 3000):
        ids = prompt[None].repeat(3000, 1)
        seqs = fn(ids, g)[:, prompt.shape[0]:]
        assert seqs.shape[1] == STEPS
        for row in seqs.tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", seed=3, vocab=V, layers=2)
    # a milder init than the greedy tests: we want spread-out distributions here
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(0.5)
    prompt = ragged_batch([5], vocab=V, seed=11)[0][0]
    greedy, _ = reference_greedy(target, prompt, STEPS + 4)
    base = DFlashDraftModel.from_target(target, block_size=4, mask_token_id=V - 1)
    # proposes the greedy path: accepted exactly when the sample agrees with it, which is often
    oracle = OracleDraft(base, [prompt.tolist() + greedy])
    return target, prompt, base, oracle


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.9)])
def test_spec_and_plain_sampling_match_exact_distribution(setup, temperature, top_k, top_p):
    target, prompt, base, oracle = setup
    probs = exact_joint(target, prompt, temperature, top_k, top_p)
    kw = dict(max_new_tokens=STEPS, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=[])
    runs = {
        "ar": lambda ids, g: ar_generate(target, ids, generator=g, **kw),
        "spec-oracle": lambda ids, g: spec_generate(target, oracle, ids, generator=g, **kw),
        "spec-random": lambda ids, g: spec_generate(target, base, ids, generator=g, **kw),
    }
    for name, fn in runs.items():
        z = chi_square_z(sample_counts(fn, prompt, seed=17), probs, N)
        assert z < 4.0, f"{name}: sampled distribution differs from the target's (z={z:.1f})"
    # prompt lookup: after a prompt holding every pair of tokens, each step's block starts with the text's own
    # continuation of its last 3 (else 2) tokens ahead of the draft's proposals
    pairs = every_pair()
    lookup = sample_counts(lambda ids, g: spec_generate(target, base, ids, generator=g, prompt_lookup=True, **kw),
                           pairs, seed=17)
    z = chi_square_z(lookup, exact_joint(target, pairs, temperature, top_k, top_p), N)
    assert z < 4.0, f"spec-lookup: sampled distribution differs from the target's (z={z:.1f})"
    # support: nothing is ever sampled that top-k/top-p excluded
    counts = sample_counts(runs["spec-oracle"], prompt, seed=5)
    assert all(probs[k] > 0 for k in counts)


def test_the_test_detects_a_wrong_distribution(setup):
    target, prompt, _, oracle = setup
    probs = exact_joint(target, prompt, 1.0, 0, 1.0)
    wrong = sample_counts(lambda ids, g: spec_generate(target, oracle, ids, generator=g, max_new_tokens=STEPS,
                                                       temperature=1.25, stop_token_ids=[]), prompt, seed=17)
    assert chi_square_z(wrong, probs, N) > 4.0


def test_acceptance_happens_when_sampling(setup):
    target, prompt, _, oracle = setup
    out = spec_generate(target, oracle, prompt[None].repeat(200, 1), max_new_tokens=STEPS, temperature=1.0,
                        stop_token_ids=[], generator=torch.Generator().manual_seed(0), return_stats=True)
    assert out.tau > 1.1 and max(out.acceptance_lengths) >= 3


def test_seeded_sampling_is_reproducible(setup):
    target, prompt, base, _ = setup
    a = spec_generate(target, base, prompt, max_new_tokens=20, temperature=1.0, stop_token_ids=[],
                      generator=torch.Generator().manual_seed(3))
    b = spec_generate(target, base, prompt, max_new_tokens=20, temperature=1.0, stop_token_ids=[],
                      generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
