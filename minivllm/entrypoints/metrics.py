from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..outputs import RequestOutput
from .async_llm import AsyncLLM

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)


class EngineMetrics:
    "Prometheus metrics of an AsyncLLM (vLLM's names, under `minivllm:`), updated by its engine thread after each step."

    def __init__(self, llm: AsyncLLM, registry: CollectorRegistry):
        self.llm, self.seen = llm, {}   # request id -> (time of its last token, tokens so far)
        m = "minivllm:"
        self.running = Gauge(m + "num_requests_running", "Requests in the running batch.", registry=registry)
        self.waiting = Gauge(m + "num_requests_waiting", "Requests waiting to run.", registry=registry)
        self.kv_usage = Gauge(m + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use.", registry=registry)
        self.prompt_tokens = Counter(m + "prompt_tokens", "Prompt tokens computed.", registry=registry)
        self.generation_tokens = Counter(m + "generation_tokens", "Tokens generated.", registry=registry)
        self.ttft = Histogram(m + "time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.itl = Histogram(m + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(m + "e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.counted = (0, 0)
        llm.step_hooks.append(self.record)

    def record(self, outputs: list[RequestOutput], now: float) -> None:
        engine = self.llm.engine
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(self.llm.num_waiting)
        self.kv_usage.set(engine.scheduler.block_manager.usage)
        prompt, generated = engine.stats.num_prompt_tokens, engine.stats.num_generated_tokens
        self.prompt_tokens.inc(prompt - self.counted[0])
        self.generation_tokens.inc(generated - self.counted[1])
        self.counted = (prompt, generated)
        for out in outputs:
            self._latencies(out)
        if len(self.seen) > 2 * len(self.llm.streams) + 64:   # forget aborted requests
            self.seen = {k: v for k, v in self.seen.items() if k in self.llm.streams}

    def _latencies(self, out: RequestOutput) -> None:
        "Time to first token once per request; the gaps between its tokens (an output may bring several)."
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        if out.request_id not in self.seen:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.seen[out.request_id] = (m.first_token_time, 1)
        last, count = self.seen[out.request_id]
        if (new := m.num_generated_tokens - count) > 0:
            for _ in range(new):
                self.itl.observe((m.last_token_time - last) / new)
            self.seen[out.request_id] = (m.last_token_time, m.num_generated_tokens)
        if out.finished:
            self.e2e.observe((m.finished_time or m.last_token_time) - m.arrival_time)
            self.seen.pop(out.request_id, None)
