"""Tests start real gateways with the same launcher the benchmarks use."""

from bench.gateway_proc import free_port, run_gateway, wait_http, wait_ready

__all__ = ["free_port", "run_gateway", "wait_http", "wait_ready"]
