"""What the core's operations cost, measured in this process with no model (``storage``: a
turn's bookkeeping, history loads, claims, truncation, the sweeper; ``snapshots``; what usage,
budgets and traces add: ``observability``; what an MCP call and an approval add: ``tools``),
and two finer CPU measurements kept for the figures docs/benchmarks.md reports
(``bookkeeping``, ``history_load``)."""
