"""Benchmarks, apart from the tests: they measure and record; tests assert behaviour.

Layout:
- `stress.py`        `millstream stress`: envpool workers at N concurrent episodes, faults, a report;
- `stress_report.py` the report: workers' statistics over time, the table, JSON and the plot;
- `stress_suite.py`  the recorded scenarios (`make bench-stress`), results in `results/`;
- `fleet.py`         actor replicas: throughput by replica count, router overhead, weight sync time;
- `fleet_report.py`  its outputs: the PNG and the text table;
- `auth_cost.py`     what CURVE authentication costs;
- `rounds.py`        systems compared round by round: medians, spread, JSON and PNG;
- `all.py`           every benchmark (`make bench`, `make bench-quick`);
- `async_sync.py`, `weight_sync.py`, `replicas.py`, `store_overhead.py`: one question each.

`README.md` here holds the measured numbers and how to read them.
"""
