"""The bridge: one vLLM worker's events from ZMQ to NATS.

The flow, one package a stage: `source` (ZMQ SUB and replay, continuity) →
`decode` (vLLM's wire, every release) → `normalize` (kinds, families, the tier
rule, records) → `sink` (subjects, framing, core NATS and JetStream). Beside
it: `snapshot` (the ranks' residency kept for late consumers, served and
stored), `telemetry` (the bridge's own metrics, health and HTTP), `config`
(the options), `pipeline` (one worker-rank's chain) and `service` (wiring
them in one anyio task group).
"""
