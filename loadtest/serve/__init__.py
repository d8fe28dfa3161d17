"""Serving benchmark for any OpenAI-compatible server (`kvmesh bench serve|compare|baseline`).

Modules, one concept each: datasets (what to send), payload (how a request body looks),
client (one timed HTTP request), eos (whether the server can be forced past EOS), load
(arrivals, concurrency, warm-up, time limit, sweep), metrics (vLLM `bench serve` figures),
report (table + JSON), plots (PNGs), options (CLI flags shared by serve and compare).
"""
