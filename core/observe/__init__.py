"""Observability: console and file metrics, GPU monitor, profiler reports, plots."""
