"""Prometheus metrics of the server: request outcomes, token counts, latency histograms, engine gauges; and the
main ones again under vLLM's `vllm:` names (with its `model_name` label), so dashboards built for vLLM work."""
from __future__ import annotations

from dataclasses import dataclass, field

from .engine import Engine


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """`labels`: more labels for every sample, e.g. 'model_name="m"'."""
        counts = self.counts or [0] * len(self.buckets)
        extra, only = (labels + ",", f"{{{labels}}}") if labels else ("", "")
        out = [f'{name}_bucket{{{extra}le="{b}"}} {c}' for b, c in zip(self.buckets, counts)]
        return out + [f'{name}_bucket{{{extra}le="+Inf"}} {self.n}', f"{name}_sum{only} {self.total}",
                      f"{name}_count{only} {self.n}"]


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# every outcome is exported from the start, at 0, so a dashboard's rate() sees its first occurrence
OUTCOMES = ("finished", "aborted", "error", "client_disconnected", "rejected_invalid", "rejected_overloaded")


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def render(self, engine: Engine | None, model_name: str = "") -> str:
        lines = ["# TYPE deltaserve_requests_total counter"]
        lines += [f'deltaserve_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        for name, value in (("prompt_tokens", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                            ("cached_tokens", self.cached_tokens)):
            lines += [f"# TYPE deltaserve_{name}_total counter", f"deltaserve_{name}_total {value}"]
        lines += ["# TYPE deltaserve_time_to_first_token_seconds histogram",
                  *self.ttft.lines("deltaserve_time_to_first_token_seconds"),
                  "# TYPE deltaserve_inter_token_latency_seconds histogram",
                  *self.itl.lines("deltaserve_inter_token_latency_seconds")]
        waiting = len(engine.waiting) if engine else 0
        running = len(engine.running) if engine else 0
        cache = engine.cache if engine else None
        lines += ["# TYPE deltaserve_queue_depth gauge", f"deltaserve_queue_depth {waiting}",
                  "# TYPE deltaserve_running_sequences gauge", f"deltaserve_running_sequences {running}",
                  "# TYPE deltaserve_prefix_cache_bytes gauge", f"deltaserve_prefix_cache_bytes {cache.bytes if cache else 0}",
                  "# TYPE deltaserve_prefix_cache_entries gauge",
                  f"deltaserve_prefix_cache_entries {cache.entries if cache else 0}"]
        label = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        queries, hits = (engine.prefix_cache_queries, engine.prefix_cache_hits) if engine else (0, 0)
        for kind, name, value in (("gauge", "num_requests_running", running),
                                  ("gauge", "num_requests_waiting", waiting),
                                  ("counter", "prefix_cache_queries_total", queries),     # prompt tokens looked up
                                  ("counter", "prefix_cache_hits_total", hits),           # prompt tokens reused
                                  ("counter", "prompt_tokens_total", self.prompt_tokens),
                                  ("counter", "generation_tokens_total", self.generation_tokens)):
            lines += [f"# TYPE vllm:{name} {kind}", f"vllm:{name}{{{label}}} {value}"]
        for name, histogram in (("time_to_first_token_seconds", self.ttft), ("inter_token_latency_seconds", self.itl),
                                ("time_per_output_token_seconds", self.itl)):
            lines += [f"# TYPE vllm:{name} histogram", *histogram.lines(f"vllm:{name}", label)]
        return "\n".join(lines) + "\n"
