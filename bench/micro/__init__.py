"""Micro-benchmarks: one question each (a body parse, a hold wake-up, the KV feed rate...). Run with ``python -m bench.micro.NAME``."""
