"""The paper's experiment grid: every (variant, seed) as its own run, then one table and plots.

``grid`` plans, runs (locally N at a time, or as printed launch commands) and resumes the runs;
``variants`` says what a variant is (config overrides + a trainer entry point); ``rundirs`` reads
what a run directory holds; ``aggregate`` turns the runs into ``table.md`` / ``table.json``;
``plots`` draws them; ``latency`` adds heavy-tailed command latencies to any sandbox.
See docs/experiments.md.
"""
