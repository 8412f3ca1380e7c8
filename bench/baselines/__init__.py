"""What millstream is measured against: the engine without millstream, and the load both get.

overhead_engine.py  vLLM's AsyncLLM driven directly in one process
overhead_load.py    the prompts and shapes every system of the overhead benchmark is offered
http_engine.py      the synthetic engine over HTTP, for asyncio + HTTP in pool_vs_http
"""
