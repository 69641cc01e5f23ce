"""Adaptive verify width: how many drafted tokens each step is worth checking.

A wider block commits more tokens per step only while the draft keeps being right, and it costs more: the
target verifies rows x width tokens. On a CPU, or with many rows sharing a step, that cost grows fast, and a
weak draft's far slots are almost never accepted; a fixed wide block then makes speculative decoding slower
than plain decoding (the "speed-up collapses under load" complaint). `WidthController` picks, before each
step, the width with the most expected committed tokens per second, from what it measures as it goes:

- acceptance, per block slot k: of the rows whose slots 1..k-1 were accepted and that had slot k to verify,
  the fraction that got slot k accepted too (counts decay, so the rates follow the text being written);
- cost: the step's wall time as a + b x (tokens verified), fitted over recent steps.

Width 1 is a plain decoding step (the draft cache still gets the target's features), so the choice is never
much worse than decoding without a draft. While the choice is narrow, a whole block is verified now and then
to keep measuring the far slots, less and less often while those probes change nothing. Every width keeps the
output exact: the verify rule does not depend on how many proposals are checked.
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
        self.probed = False
        self.reached = torch.zeros(block_size, dtype=torch.float64)  # [B] index k: slot k verified after 1..k-1 hit
        self.hit = torch.zeros(block_size, dtype=torch.float64)
        self.cost: dict[int, list[float]] = {}  # tokens verified -> [EMA seconds, weight]
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
        entry = self.cost.setdefault(tokens, [seconds, 0.0])
        entry[0] += 0.3 * (seconds - entry[0])
        entry[1] += 1.0

    def slot_rates(self) -> torch.Tensor:
        """[B-1] chance that slot k is accepted given slots 1..k-1 were (prior-smoothed)."""
        return ((self.hit[1:] + self.prior_rate * self.prior_weight) / (self.reached[1:] + self.prior_weight))

    def expected_tokens(self) -> torch.Tensor:
        """[B] tokens a row commits per step at width w = 1..B: 1 + the sum over k < w of P(slots 1..k hit)."""
        reach = torch.cumprod(self.slot_rates(), 0)
        return torch.cat([torch.ones(1, dtype=torch.float64), 1 + torch.cumsum(reach, 0)])

    def step_seconds(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b x tokens, least squares over the measured token counts (None: fewer than
        two of them yet)."""
        if len(self.cost) < 2:
            return None
        t = torch.tensor(list(self.cost), dtype=torch.float64)
        s = torch.tensor([v[0] for v in self.cost.values()], dtype=torch.float64)
        w = torch.tensor([v[1] for v in self.cost.values()], dtype=torch.float64).clamp(min=1e-6)
        tm, sm = (w * t).sum() / w.sum(), (w * s).sum() / w.sum()
        var = (w * (t - tm) ** 2).sum()
        b = float((w * (t - tm) * (s - sm)).sum() / var) if var > 0 else 0.0
        b = max(b, 0.0)  # noise must not make a wider block look cheaper than a narrow one
        return max(float(sm - b * tm), 1e-9), b

    # ---- the choice -------------------------------------------------------------------------------------
    def choose(self, rows: int, max_width: int | None = None) -> int:
        """The width (1..max_width) for the next step of `rows` rows."""
        cap = self.B if max_width is None else max(1, min(max_width, self.B))
        fit = self.step_seconds()
        if fit is None:
            # two token counts are needed to price width: start wide, then measure one plain step
            w = 1 if self.last == cap else cap
        else:
            a, b = fit
            widths = torch.arange(1, cap + 1, dtype=torch.float64)
            rate = rows * self.expected_tokens()[:cap] / (a + b * rows * widths)
            w = int(rate.argmax()) + 1
            if w == cap:
                self.probe_every = self.base_probe_every
            elif self.probed:
                # a probe that left the choice narrow is worth less often: its wide step costs the most when
                # many rows share it
                self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            self.probed = False
            self.since_probe += 1
            if w < cap and self.since_probe >= self.probe_every:
                w = cap  # now and then verify the whole block, so the far slots' rates stay measured
                self.since_probe, self.probed = 0, True
        self.last = w
        self.width_counts[w] += 1
        return w
