"""The operator's control loop: kopf handlers (thin) over a pure lifecycle and a REST shell.

Modules: `handlers` (kopf registration, per-job workers), `reconcile` (one pass), `status`
(pure lifecycle), `observe` (pod verdicts), `kube` (REST calls), `metrics` (/metrics,
/healthz). Started by `grpo-operator operator`.
"""
