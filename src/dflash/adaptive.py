"""Adaptive verify width: how many drafted tokens each step is worth checking.

A wider block commits more tokens per step only while the draft keeps being right, and it costs more: the
target verifies rows x width tokens. On a CPU, or with many rows sharing a step, that cost grows fast, and a
weak draft's far slots are almost never accepted; a fixed wide block then makes speculative decoding slower
than plain decoding (the "speed-up collapses under load" complaint). `WidthController` picks, before each
step, the width with the most expected committed tokens per second, from what it measures as it goes:

- acceptance, per block slot k: of the rows whose slots 1..k-1 were accepted and that had slot k to verify,
  the fraction that got slot k accepted too (counts decay, so the rates follow the text being written);
- cost: the step's wall time for this many rows at this width (without writing the draft context that
  earlier steps left pending, see SpecBatch.flush_seconds), as measured (a decaying average that damps
  outliers) where it was measured recently, else from a + b x (tokens verified) + c x (drafts were made)
  fitted over recent steps (a step with drafts also runs the draft, which a line through plain steps and whole
  blocks would spread over the widths between and so make narrow blocks look cheap; and the verify cost on a
  CPU is not quite linear, which the measured shapes correct).

Then (opt-in, see `trims_pay`), once the draft has run, `trim` cuts the step to the proposals worth verifying by
the draft's own probabilities (calibrated in a trained draft): the rates above say whether drafting pays on
average, the probabilities say how far this one block is worth checking. Drafted steps of one row then propose the
whole block (worth it where the draft's forward costs about the same at any width) and verify from 1 token (the
draft was unsure of all of them) to all of them.

Width 1 is a plain decoding step (the draft cache still gets the target's features), so the choice is never
much worse than decoding without a draft. While the choice is narrow, twice that width (from plain decoding,
the width drafting would take) is verified now and then to keep measuring the slots past it, less and less
often while those probes change nothing. Every width
keeps the output exact: the verify rule does not depend on how many proposals are checked.
"""

from __future__ import annotations

import itertools
import os

import torch


class WidthController:
    """Plain Python numbers throughout: a few dozen of them per step, where tensor ops would cost more to launch
    than to compute (and the host's time is the step's time on a GPU)."""

    def __init__(self, block_size: int, *, prior_rate: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.98, probe_every: int = 16, max_probe_every: int = 256):
        self.B = block_size
        self.prior_rate, self.prior_weight, self.decay = prior_rate, prior_weight, decay
        self.probe_every = self.base_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.since_probe = 0
        self.probed_from: int | None = None  # the width chosen before the last probe widened it
        self.reached = [0.0] * block_size  # index k: slot k verified after 1..k-1 hit
        self.hit = [0.0] * block_size
        # (rows, width, the draft ran) -> [EMA seconds, weight, steps measured]
        self.cost: dict[tuple[int, int, bool], list[float]] = {}
        self.last = None
        self.cold_start = [2, 1, 4, 1]  # the first widths, see choose
        self.width_counts = [0] * (block_size + 1)  # how often each width was verified
        # set by a caller that trims drafted steps (`trim`): `choose` then proposes a whole block where one row
        # decodes (`trimming`: this step is trimmed). Not for several rows: the draft's forward then grows with
        # the block (4 rows x 8 slots), and whole blocks trimmed lost 4-9% to the untrimmed widths (GSM8K and
        # MT-Bench, 16 prompts in batches of 4, default draft, AVX-512 Xeon, 2 threads)
        self.trims = False
        self.trimming = False
        self._beyond: list[list[float]] | None = None  # the last trim's cut-off probabilities, per row
        # recent trimmed steps (decaying sums): drafts the draft's probabilities expected to be accepted, rows,
        # and the seconds the cost model gave them; and, remembered longer, drafts accepted against drafts
        # expected, which corrects a draft whose probabilities run high or low
        self.drafted = [0.0, 0.0, 0.0]
        self.calibration = [4.0, 4.0]
        self._expected: tuple[float, float] | None = None  # the last trim's expected drafts and seconds
        # what the last choice that trims found: tokens per second it expects to make, and the cost fit (a, b, c)
        self._worth: float = 0.0
        self._fit: tuple[float, float, float] | None = None

    # ---- what was measured -----------------------------------------------------------------------------
    def observe(self, accepted: list[int], width: int, tokens: int, seconds: float,
                drafted: bool | None = None) -> None:
        """One step: accepted drafts per row (0..width-1), its width, the tokens it verified, its seconds, and
        whether the draft ran (default: width > 1; proposals looked up in the text cost no draft forward)."""
        # rows with at least m drafts accepted, m = 0..B
        at_least = [0] * (self.B + 1)
        for a in accepted:
            at_least[min(a, self.B)] += 1
        at_least = list(itertools.accumulate(reversed(at_least)))[::-1]
        # slot k was verified when slots 1..k-1 were accepted and k < width; it was accepted when a >= k
        for k in range(self.B):
            self.reached[k] = self.reached[k] * self.decay + (at_least[k - 1] if 1 <= k < width else 0)
            self.hit[k] = self.hit[k] * self.decay + (at_least[k] if k >= 1 else 0)
        beyond, self._beyond = self._beyond, None
        if beyond is not None:
            # slots that `trim` cut off: a row whose verified proposals were all accepted would have reached
            # them, and the draft's probabilities stand in for what verifying them would have shown; counting
            # only verified slots would measure the confident ones alone and price untrimmed widths too high
            for a, probs in zip(accepted, beyond):
                if a == width - 1:
                    reach = 1.0
                    for k, p in enumerate(probs, start=width):
                        self.reached[k] += reach
                        reach *= p
                        self.hit[k] += reach
        for entry in self.cost.values():
            entry[1] *= self.decay
        self.drafted = [v * self.decay for v in self.drafted]
        expected, self._expected = self._expected, None
        if expected is not None:
            self.drafted[0] += expected[0]
            self.drafted[1] += len(accepted)
            self.drafted[2] += expected[1]
            self.calibration = [self.calibration[0] * 0.995 + sum(accepted), self.calibration[1] * 0.995 + expected[0]]
        # [EMA seconds, weight, steps measured]
        entry = self.cost.setdefault(self._key(tokens // width, width, drafted), [seconds, 0.0, 0])
        if entry[2] < 2:
            # a shape's first two steps: the faster (the first of a shape often pays for buffers and first
            # calls: the default draft's first plain step took 6.3 ms where the next ones took 5, and the choice
            # drafted for twenty steps against that price)
            entry[0] = min(entry[0], seconds)
        else:
            # one slow step (a collection, the OS) moves a shape's price up by at most 7.5%: priced dear, a shape
            # is chosen, and so measured, no more, and one outlier kept the best width out of use for ~80 steps
            # (the default draft on GSM8K, AVX-512 Xeon: 14 ms for width 3 where its steps took 8)
            entry[0] += 0.3 * (min(seconds, 1.25 * entry[0]) - entry[0])
        entry[1] += 1.0
        entry[2] += 1

    def slot_rates(self) -> list[float]:
        """[B-1] chance that slot k is accepted given slots 1..k-1 were, each smoothed toward the slot before it
        (slot 1 toward `prior_rate`): far slots are reached rarely, and a fixed optimistic prior would keep
        them looking better than they are."""
        rates, prior = [], self.prior_rate
        for hit, reached in zip(self.hit[1:], self.reached[1:]):
            prior = (hit + prior * self.prior_weight) / (reached + self.prior_weight)
            rates.append(prior)
        return rates

    def expected_tokens(self) -> list[float]:
        """[B] tokens a row commits per step at width w = 1..B: 1 + the sum over k < w of P(slots 1..k hit)."""
        reach = list(itertools.accumulate(self.slot_rates(), lambda x, y: x * y))
        return [1.0] + [1.0 + r for r in itertools.accumulate(reach)]

    def step_seconds(self) -> tuple[float, float, float] | None:
        """(a, b, c) of seconds = a + b x tokens + c x (drafts were made), weighted least squares over the
        measured step shapes: c is the draft's own forward, which a plain step skips (0 until the measured
        shapes can tell it from the verify cost). None: fewer than two token counts measured yet."""
        rows = [(1.0, float(r * w), float(d), v[0], max(v[1], 1e-6)) for (r, w, d), v in self.cost.items()]
        if len({x[1] for x in rows}) < 2:
            return None
        coef = _weighted_least_squares([x[:3] for x in rows], [x[3] for x in rows], [x[4] for x in rows])
        if coef is None:  # the shapes so far cannot tell the draft's cost from the verify's
            coef = _weighted_least_squares([x[:2] for x in rows], [x[3] for x in rows], [x[4] for x in rows]) + [0.0]
        a, b, c = coef
        # noise must not make a wider block, or drafting, look cheaper than plain decoding
        return max(a, 1e-9), max(b, 0.0), max(c, 0.0)

    @staticmethod
    def _key(rows: int, width: int, drafted: bool | None) -> tuple[int, int, bool]:
        return rows, width, width > 1 if drafted is None else drafted  # a chain step wider than 1 ran the draft

    def _measured(self, rows: int, width: int, drafted: bool | None = None) -> float | None:
        """Seconds of a step of this shape, if measured recently enough to trust (its weight decays, so an
        old measurement gives way to the fit, and the choice it makes measures the shape again)."""
        entry = self.cost.get(self._key(rows, width, drafted))
        return entry[0] if entry is not None and entry[1] >= 0.25 else None

    # ---- the choice -------------------------------------------------------------------------------------
    def choose(self, rows: int, max_width: int | None = None) -> int:
        """The width (1..max_width) for the next step of `rows` rows."""
        cap = self.B if max_width is None else max(1, min(max_width, self.B))
        fit = self.step_seconds()
        exact = bool(self.cold_start) or fit is None  # a cold-start shape: measured as chosen, not trimmed
        if self.cold_start:
            # three shapes price width (the plain one twice, as it prices every other choice): a step of two, a
            # plain one, and one of four, which tells the draft's own cost from the verify's (with two, a line
            # through them charges the draft to every verified token, and wider blocks looked several times
            # dearer than they are: the choice stayed plain). Not a whole block: where verifying is dear that step
            # alone costs several plain ones, and a good draft shows in slot 1, whose rate the far slots are
            # smoothed toward, so the next choice can go wide at once.
            w = min(self.cold_start.pop(0), cap)
        elif fit is None:
            w = 1 if self.last is not None and self.last > 1 else min(2, cap)
        else:
            a, b, c = fit
            seconds = [self._measured(rows, w) or a + b * rows * w + c * (w > 1) for w in range(1, cap + 1)]
            rate = [rows * e / t for e, t in zip(self.expected_tokens()[:cap], seconds)]
            w = rate.index(max(rate)) + 1
            if self.trims and rows == 1:
                # drafting pays where some untrimmed width does, or where trimmed steps did of late (a step's worth
                # at least), as the draft's probabilities (calibrated by what was accepted) value them: a draft
                # that is sure where it is right pays trimmed where no fixed width does
                best = max(rate[1:], default=0.0)
                if self.drafted[1] >= 1.0:
                    cal = self.calibration[0] / self.calibration[1]
                    best = max(best, (self.drafted[1] + cal * self.drafted[0]) / self.drafted[2])
                w = cap if best > rate[0] else 1
                self._worth, self._fit = max(best, rate[0]), fit
            if self.probed_from is not None:  # the step after a probe
                # a probe that widened the choice found more to gain: look further soon; one that changed
                # nothing is worth less often, since its wide step costs the most when many rows share it
                self.probe_every = (self.base_probe_every if w > self.probed_from
                                    else min(2 * self.probe_every, self.max_probe_every))
                self.probed_from = None
            elif w == cap:
                self.probe_every = self.base_probe_every
            self.since_probe += 1
            if w < cap and self.since_probe >= self.probe_every:
                # now and then verify twice the chosen width, so the slots just past it stay measured; a
                # far slot matters only once the nearer ones pay, and where verifying is dear (a CPU without
                # fast multi-row kernels) a whole-block probe costs several plain steps. From plain decoding,
                # the width that drafting would take: where the draft's forward is most of a drafted step's cost,
                # width 2 can lose to plain steps while 4 wins, and probes of 2 alone, one slot each, left the
                # choice plain for a hundred steps of a draft whose width 4 paid
                best_drafted = 1 + rate.index(max(rate[1:]), 1) if cap > 1 else 1
                self.probed_from, w = w, min(cap, max(2 * w, best_drafted))
                self.since_probe = 0
        self.last = w
        self.trimming = self.trims and rows == 1 and w > 1 and not exact
        if self.trimming:
            w = cap  # `trim` verifies what pays of the whole block
        self.width_counts[w] += 1
        return w

    def trim(self, probs: list[list[float]], width: int) -> int:
        """How many of a drafted step's `width` tokens to verify (1..width), given the draft's probability of
        each proposal per row, probs [rows][width - 1]: the most expected committed tokens beyond what their
        seconds are worth at the steps' rate, a row's slot k counting as accepted with the product of its
        probabilities up to k (corrected by `calibration`), the seconds from the fitted cost of a step that ran
        the draft. Counts the step at that width and keeps the cut-off probabilities for `observe`, which must
        be told the width verified."""
        if not self.trimming or width <= 1:
            return width
        a, b, c = self._fit
        rows = len(probs)
        cal = self.calibration[0] / self.calibration[1]  # a draft sure of too much, or too little
        expected = [float(rows)] * width  # index v - 1: tokens the rows commit at width v
        for row in probs:
            reach = 1.0
            for k in range(1, width):
                p = row[k - 1]
                reach *= min(1.0, cal * p) if 0.0 <= p <= 1.0 else 0.0  # a NaN from a broken draft: a miss
                expected[k] += reach
        expected = list(itertools.accumulate(expected, lambda acc, e: acc + e - rows))
        # priced by the fit alone: a shape measured once (its first step is often slow) would otherwise keep its
        # width out of use while an unmeasured neighbour, priced by the fit, took every step
        seconds = [a + b * rows * v + c for v in range(1, width + 1)]
        # a token verified is worth its seconds at the rate the steps make (the best the choice expected): a
        # step's own best ratio would take unsure slots that pay less than the steps around them do
        value = [e - self._worth * t for e, t in zip(expected, seconds)]
        v = value.index(max(value)) + 1
        self._expected = (expected[v - 1] - rows, seconds[v - 1])
        self.width_counts[width] -= 1
        self.width_counts[v] += 1
        self._beyond = [row[v - 1:width - 1] for row in probs] if v < width else None
        return v


def trims_pay(device) -> bool:
    """Whether drafted steps are trimmed (`WidthController.trim`): only where DFLASH_TRIM=1 asks for it, and only on
    a CPU (on a GPU a few more verified tokens cost next to nothing, and reading the draft's probabilities would
    stall the device's queue between the draft and the verify: a second host synchronisation per step).
    A trimmed step proposes the whole block, and since dflash's int4 kernels stream each weight once per thread a
    block's rows cost more than they did (30 layers' int4 products: 2.42 / 2.73 / 4.04 ms for 1 / 4 / 8 rows, AMD
    EPYC (AVX-512), 2 threads, benchmarks/linear_rows.py). There, with the shipped draft, the untrimmed widths did
    as well or better: `dflash bench --datasets gsm8k,humaneval,mt-bench --num-prompts 20 --methods
    ar,dflash-adaptive` gave 1.18x / 1.07x / 1.11x untrimmed and 1.16x / 0.89x / 0.99x with DFLASH_TRIM=1."""
    return torch.device(device).type == "cpu" and os.environ.get("DFLASH_TRIM", "0") == "1"


def _weighted_least_squares(x: list[tuple[float, ...]], y: list[float], w: list[float]) -> list[float] | None:
    """argmin over beta of sum w (x.beta - y)^2, by the normal equations (Gaussian elimination with pivoting);
    None where they are singular (the columns of x cannot be told apart)."""
    n = len(x[0])
    a = [[sum(wi * xi[r] * xi[c] for xi, wi in zip(x, w)) for c in range(n)] +
         [sum(wi * xi[r] * yi for xi, yi, wi in zip(x, y, w))] for r in range(n)]
    scale = max(abs(v) for row in a for v in row[:n]) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col])]
    return [a[r][n] / a[r][r] for r in range(n)]


PLAIN, NGRAM, TREE = "plain", "ngram", "tree"


class TreeBudgetController:
    """Adaptive candidate trees (dflash.tree): what each step verifies. The options: a plain step; the text's
    n-gram continuation alone, as a chain of up to `size` tokens (no draft forward: the lookup is free); or a
    tree of `size` draft nodes (plus the n-gram branch). Each option's payoff is measured as it is used (a
    decaying average of the drafts a row gets accepted), separately for each length of the n-gram match the row
    had (a long match goes on far more often than a one-token one, so the same step is worth checking after
    one and not after the other), and its cost by WidthController's model of a step's seconds from the tokens
    it verifies and whether the draft ran. So trees stay small where verifying is dear (a CPU, many rows) and
    grow where it is cheap, and where the draft does not pay its own forward the text's repeats still can.
    The next larger option is tried now and then, less often while it does not pay."""

    MATCH_BUCKETS = (0, 1, 2, 4, 6)  # n-gram match lengths told apart: none, 1, 2-3, 4-5, 6+

    def __init__(self, block_size: int, budgets: list[int] | None = None, ngram_sizes: list[int] | None = None, *,
                 prior_accepted: float = 0.5, prior_weight: float = 2.0, decay: float = 0.95, probe_every: int = 16,
                 max_probe_every: int = 256):
        # small trees too: on a CPU each node costs about a token's verify, and the n-gram branch (added to
        # any tree) alone already pays where the text repeats
        budgets = sorted(set(budgets or [2, 4, block_size, 2 * block_size, 4 * block_size]) - {0})
        ngram = sorted(set([1, 3, block_size - 1] if ngram_sizes is None else ngram_sizes))
        # cheapest first, which is the order probes widen in
        self.options = [(PLAIN, 0)] + [(NGRAM, k) for k in ngram if 0 < k < block_size] + [(TREE, b) for b in budgets]
        self.cost = WidthController(block_size, decay=0.98)
        # [mean accepted, weight] per option and match bucket
        self.gain = {(o, m): [prior_accepted, prior_weight] for o in self.options[1:] for m in self.MATCH_BUCKETS}
        self.decay = decay
        self.probe_every = self.base_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.since_probe = 0
        self.probing: tuple[str, int] | None = None  # the option a probe widened from
        self.last: tuple[str, int] | None = None
        self.counts = {o: 0 for o in self.options}

    @property
    def largest_tree(self) -> int:
        return max(size for kind, size in self.options if kind == TREE)

    def choice_counts(self) -> dict[str, int]:
        """Steps per option chosen so far, named as in stats lines ("plain", "ngram-3", "tree-8")."""
        return {kind if kind == PLAIN else f"{kind}-{size}": n for (kind, size), n in self.counts.items() if n}

    @classmethod
    def bucket(cls, match: int) -> int:
        return max(b for b in cls.MATCH_BUCKETS if b <= match)

    def expected_accepted(self, option: tuple[str, int], match: int) -> float:
        if option[0] == PLAIN or (option[0] == NGRAM and match == 0):  # nothing to propose
            return 0.0
        return self.gain[option, self.bucket(match)][0]

    @staticmethod
    def width(option: tuple[str, int]) -> int:
        return option[1] + 1  # the anchor and the proposals (a tree's nodes are keyed by its budget)

    def choose(self, rows: int, matches: list[int] | None = None) -> tuple[str, int]:
        """The option for the next step of `rows` rows, whose n-gram matches are `matches` long (None: no
        lookup, so no n-gram chains)."""
        matches = [0] * rows if matches is None else matches
        options = self.options if any(matches) else [o for o in self.options if o[0] != NGRAM]
        fit = self.cost.step_seconds()
        if fit is None:  # price two sizes first: a small tree, then a plain step
            small = next(o for o in self.options if o[0] == TREE)
            choice = small if self.last != small else (PLAIN, 0)
        else:
            a, slope, drafted = fit

            def rate(o):
                w, d = self.width(o), o[0] == TREE
                seconds = self.cost._measured(rows, w, d) or a + slope * rows * w + drafted * d
                return sum(1 + self.expected_accepted(o, m) for m in matches) / seconds

            choice = max(options, key=rate)
            if self.probing is not None:
                grew = self.options.index(choice) > self.options.index(self.probing)
                self.probe_every = self.base_probe_every if grew else min(2 * self.probe_every, self.max_probe_every)
                self.probing = None
            self.since_probe += 1
            bigger = [o for o in options if self.options.index(o) > self.options.index(choice)]
            if bigger and self.since_probe >= self.probe_every:
                self.probing, choice = choice, bigger[0]
                self.since_probe = 0
        self.last = choice
        self.counts[choice] += 1
        return choice

    def observe(self, accepted: list[int], option: tuple[str, int], seconds: float, matches: list[int] | None = None,
                width: int | None = None) -> None:
        """One step: accepted drafts per row, the option it ran, its seconds, the rows' n-gram match lengths and
        the width it verified (an n-gram chain is as wide as its longest proposal; default: the option's)."""
        rows = len(accepted)
        w = self.width(option) if width is None else width
        self.cost.observe([0] * rows, w, rows * w, seconds, drafted=option[0] == TREE)
        if option[0] == PLAIN:
            return
        by_bucket: dict[int, list[int]] = {}
        for a, m in zip(accepted, [0] * rows if matches is None else matches):
            if option[0] != NGRAM or m > 0:  # a row with nothing proposed took a plain step
                by_bucket.setdefault(self.bucket(m), []).append(a)
        for m, got in by_bucket.items():  # one decay per step, whatever the rows
            g = self.gain[option, m]
            g[1] *= self.decay
            g[0] += (sum(got) / len(got) - g[0]) * len(got) / (g[1] + len(got))
            g[1] += len(got)
