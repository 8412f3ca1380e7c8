"""Benchmarks, apart from the tests: they measure and record; tests assert behaviour.

Layout (each module is one benchmark, run with `python -m millstream.bench.NAME`, or
`millstream.bench.learning.NAME` in learning/):

    all.py              every benchmark (`make bench`, `make bench-quick`)
    stress.py           `millstream stress`: envpool workers at N concurrent episodes, faults
    stress_suite.py     the recorded scenarios (`make bench-stress`)
    overhead.py         millstream's actor path against vLLM's AsyncLLM alone and `vllm serve`
    pool_vs_http.py     envpool against one asyncio process speaking HTTP to the same engine
    async_sync.py       asynchronous against synchronous training, same tokens
    weight_sync.py      a weight push against a raw gloo broadcast of the same bytes
    fleet.py            actor replicas: throughput by count, router overhead, sync time
    auth_cost.py        what CURVE authentication costs
    store_overhead.py   what the trajectory store costs the envpool
    inspect_speed.py    how fast `millstream inspect` answers on a 10,000-episode store
    learning/           does it learn: a learning test's margins, a real model's accuracy
    kit/                what they are built from: rounds, /proc CPU, replicas, reports
    baselines/          what millstream is measured against: AsyncLLM alone, HTTP, the load

`README.md` here holds the measured numbers and how to read them.
"""
