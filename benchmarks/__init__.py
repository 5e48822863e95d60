"""Benchmarks: a table of scenarios (scenarios.py), one runner (run.py), the load generator (loadgen.py);
`make bench` runs every scenario, `make bench-quick` a quick subset, `make bench SCENARIO=<name>` one."""
