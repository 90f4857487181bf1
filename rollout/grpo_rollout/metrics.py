"""Prometheus metrics of one rollout server, exposed on GET /metrics.

One registry per server object (not the process-global default), so tests and embedded servers can
make several without name clashes. The server updates them; nothing else reads them.
"""

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class RolloutMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "grpo_rollout_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "code"],
            registry=r,
        )
        self.sequences = Counter("grpo_rollout_sequences", "Completions generated.", registry=r)
        self.tokens = Counter("grpo_rollout_tokens_generated", "Completion tokens sampled.", registry=r)
        self.prompt_tokens = Counter("grpo_rollout_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.latency = Histogram(
            "grpo_rollout_generate_seconds",
            "Wall time of a /generate request, generation plus rewards.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.weight_version = Gauge("grpo_rollout_weight_version", "Weight version in use.", registry=r)
        self.weight_loads = Counter("grpo_rollout_weight_loads", "Weight versions applied.", registry=r)
        self.reward_failures = Counter(
            "grpo_rollout_reward_failures",
            "Samples a reward function failed to score.",
            ["function"],
            registry=r,
        )
        self.reward_timeouts = Counter(
            "grpo_rollout_reward_timeouts",
            "Of the failed samples, those with no verdict in time (a reward's own budget or "
            "reward.timeoutSeconds): scored 0, but no judgement of the answer.",
            ["function"],
            registry=r,
        )
        self.handed_back = Counter(
            "grpo_rollout_prompts_handed_back", "Prompts returned unfinished.", registry=r
        )
        self.in_flight = Gauge(
            "grpo_rollout_in_flight", "Generate requests being served or queued.", registry=r
        )
        self.draining = Gauge("grpo_rollout_draining", "1 once SIGTERM arrived.", registry=r)
