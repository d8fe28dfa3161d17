"""The `kvmesh` console entry (cli.py), the benchmarks behind `kvmesh bench ...` and their library.

One-off experiments are in loadtest/experiments/<topic>/: not shipped, and nothing outside them imports them."""
