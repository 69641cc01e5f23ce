"""Adaptive verify width: how many drafted tokens each step is worth checking.

A wider block commits more tokens per step only while the draft keeps being right, and it costs more: the
target verifies rows x width tokens. On a CPU, or with many rows sharing a step, that cost grows fast, and a
weak draft's far slots are almost never accepted; a fixed wide block then makes speculative decoding slower
than plain decoding (the "speed-up collapses under load" complaint). `WidthController` picks, before each
step, the width with the most expected committed tokens per second, from what it measures as it goes:

- acceptance, per block slot k: of the rows whose slots 1..k-1 were accepted and that had slot k to verify,
  the fraction that got slot k accepted too (counts decay, so the rates follow the text being written);
- cost: the step's wall time for this many rows at this width, as measured (a decaying average) where it was
  measured recently, else from a + b x (tokens verified) + c x (drafts were made) fitted over recent steps
  (a step with drafts also runs the draft, which a line through plain steps and whole blocks would spread
  over the widths between and so make narrow blocks look cheap; and the verify cost on a CPU is not quite
  linear, which the measured shapes correct).

Width 1 is a plain decoding step (the draft cache still gets the target's features), so the choice is never
much worse than decoding without a draft. While the choice is narrow, twice that width is verified now and
then to keep measuring the slots past it, less and less often while those probes change nothing. Every width
keeps the output exact: the verify rule does not depend on how many proposals are checked.
"""

from __future__ import annotations

import torch


class WidthController:
    def __init__(self, block_size: int, *, prior_rate: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.98, probe_every: int = 16, max_probe_every: int = 256):
        self.B = block_size
        self.prior_rate, self.prior_weight, self.decay = prior_rate, prior_weight, decay
        self.probe_every = self.base_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.since_probe = 0
        self.probed_from: int | None = None  # the width chosen before the last probe widened it
        self.reached = torch.zeros(block_size, dtype=torch.float64)  # [B] index k: slot k verified after 1..k-1 hit
        self.hit = torch.zeros(block_size, dtype=torch.float64)
        self.cost: dict[tuple[int, int], list[float]] = {}  # (rows, width) -> [EMA seconds, weight]
        self.last = None
        self.width_counts = [0] * (block_size + 1)  # how often each width was chosen

    # ---- what was measured -----------------------------------------------------------------------------
    def observe(self, accepted: list[int], width: int, tokens: int, seconds: float) -> None:
        """One step: accepted drafts per row (0..width-1), its width, the tokens it verified, its seconds."""
        self.reached *= self.decay
        self.hit *= self.decay
        a = torch.tensor(accepted, dtype=torch.float64)[:, None]
        k = torch.arange(self.B, dtype=torch.float64)
        # slot k was verified when slots 1..k-1 were accepted and k < width; it was accepted when a >= k
        self.reached += ((a >= k - 1) & (k >= 1) & (k < width)).sum(0)
        self.hit += ((a >= k) & (k >= 1)).sum(0)
        for entry in self.cost.values():
            entry[1] *= self.decay
        entry = self.cost.setdefault((tokens // width, width), [seconds, 0.0])
        entry[0] += 0.3 * (seconds - entry[0])
        entry[1] += 1.0

    def slot_rates(self) -> torch.Tensor:
        """[B-1] chance that slot k is accepted given slots 1..k-1 were, each smoothed toward the slot before it
        (slot 1 toward `prior_rate`): far slots are reached rarely, and a fixed optimistic prior would keep
        them looking better than they are."""
        rates, prior = [], self.prior_rate
        for hit, reached in zip(self.hit[1:].tolist(), self.reached[1:].tolist()):
            prior = (hit + prior * self.prior_weight) / (reached + self.prior_weight)
            rates.append(prior)
        return torch.tensor(rates, dtype=torch.float64)

    def expected_tokens(self) -> torch.Tensor:
        """[B] tokens a row commits per step at width w = 1..B: 1 + the sum over k < w of P(slots 1..k hit)."""
        reach = torch.cumprod(self.slot_rates(), 0)
        return torch.cat([torch.ones(1, dtype=torch.float64), 1 + torch.cumsum(reach, 0)])

    def step_seconds(self) -> tuple[float, float, float] | None:
        """(a, b, c) of seconds = a + b x tokens + c x (drafts were made), weighted least squares over the
        measured step shapes: c is the draft's own forward, which a plain step skips (0 until the measured
        shapes can tell it from the verify cost). None: fewer than two token counts measured yet."""
        shapes = list(self.cost)
        t = torch.tensor([r * w for r, w in shapes], dtype=torch.float64)
        if len(t.unique()) < 2:
            return None
        drafted = torch.tensor([float(w > 1) for _, w in shapes], dtype=torch.float64)
        s = torch.tensor([v[0] for v in self.cost.values()], dtype=torch.float64)
        sw = torch.tensor([v[1] for v in self.cost.values()], dtype=torch.float64).clamp(min=1e-6).sqrt()
        x = torch.stack([torch.ones_like(t), t, drafted], 1)
        if torch.linalg.matrix_rank(x) < 3:  # the shapes so far cannot tell the draft's cost from the verify's
            x = x[:, :2]
        coef = torch.linalg.lstsq(x * sw[:, None], (s * sw)[:, None]).solution[:, 0].tolist()
        a, b, c = coef + [0.0] * (3 - len(coef))
        # noise must not make a wider block, or drafting, look cheaper than plain decoding
        return max(a, 1e-9), max(b, 0.0), max(c, 0.0)

    def _measured(self, rows: int, width: int) -> float | None:
        """Seconds of a step of this shape, if measured recently enough to trust (its weight decays, so an
        old measurement gives way to the fit, and the choice it makes measures the shape again)."""
        entry = self.cost.get((rows, width))
        return entry[0] if entry is not None and entry[1] >= 0.25 else None

    # ---- the choice -------------------------------------------------------------------------------------
    def choose(self, rows: int, max_width: int | None = None) -> int:
        """The width (1..max_width) for the next step of `rows` rows."""
        cap = self.B if max_width is None else max(1, min(max_width, self.B))
        fit = self.step_seconds()
        if fit is None:
            # two token counts are needed to price width: one step of two, then a plain one (not a whole block:
            # where verifying is dear that first step alone costs several plain ones, and a good draft shows in
            # slot 1, whose rate the far slots are smoothed toward, so the next choice can go wide at once)
            w = 1 if self.last is not None and self.last > 1 else min(2, cap)
        else:
            a, b, c = fit
            seconds = torch.tensor([self._measured(rows, w) or a + b * rows * w + c * (w > 1)
                                    for w in range(1, cap + 1)], dtype=torch.float64)
            rate = rows * self.expected_tokens()[:cap] / seconds
            w = int(rate.argmax()) + 1
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
                # fast multi-row kernels) a whole-block probe costs several plain steps
                self.probed_from, w = w, min(cap, 2 * w)
                self.since_probe = 0
        self.last = w
        self.width_counts[w] += 1
        return w
