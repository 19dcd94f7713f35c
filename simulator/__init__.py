"""An SGLang 0.5.x-compatible engine simulator.

It speaks SGLang's HTTP, SSE, KV-event and PD wire formats, keeps a real page-granular
radix prefix cache per worker, and schedules requests with continuous batching in
simulated time driven by a calibrated cost model. No GPU, no model weights.
"""
