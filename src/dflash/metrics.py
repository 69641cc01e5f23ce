"""Prometheus metrics of a serving engine (names follow vLLM's where they mean the same thing)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self, block_size: int):
        self.registry = r = CollectorRegistry()  # one per engine: several servers in one process stay apart
        self.requests = Counter("dflash_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", registry=r)
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens committed per sequence per step (τ), "
                                    "bonus token included", buckets=list(range(1, block_size + 1)), registry=r)
        self.draft_proposed = Counter("dflash_draft_tokens_proposed", "Draft tokens proposed", registry=r)
        self.draft_accepted = Counter("dflash_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.acceptance_rate = Gauge("dflash_draft_acceptance_rate", "Accepted / proposed draft tokens since start",
                                     registry=r)
        self.running = Gauge("dflash_num_requests_running", "Sequences in the decoding batch", registry=r)
        self.waiting = Gauge("dflash_num_requests_waiting", "Sequences queued or being prefilled", registry=r)
        self.step_time = Histogram("dflash_step_seconds", "Wall time of one engine step",
                                   buckets=[.005, .01, .02, .05, .1, .2, .5, 1, 2, 5], registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Arrival to first token",
                              buckets=[.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30], registry=r)
        self.block_size = block_size
        self._proposed = self._accepted = 0

    def observe_step(self, engine, updates, finished, seconds: float) -> None:
        drafts = engine.runner.last_width - 1  # per row of this step's decode (narrower than a block when adaptive)
        proposed = accepted = 0
        for seq, tokens, acc in updates:
            if acc is None:  # the first token, from the prefill
                self.prompt_tokens.inc(seq.num_prompt_tokens)
                self.ttft.observe(seq.first_token_time - seq.arrival_time)
            elif self.block_size > 1:
                self.acceptance.observe(acc)
                proposed += drafts
                accepted += acc - 1
        self.generation_tokens.inc(sum(len(t) for _, t, _ in updates))
        if proposed:
            self.draft_proposed.inc(proposed)
            self.draft_accepted.inc(accepted)
            self._proposed += proposed
            self._accepted += accepted
            self.acceptance_rate.set(self._accepted / self._proposed)
        for seq in finished:
            self.requests.labels(seq.finish_reason).inc()
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(engine.scheduler.num_waiting + len(engine.scheduler.prefilling))
        self.step_time.observe(seconds)
