"""A Mooncake-format trace of bursts that share a system prompt, for ``routing_quality --trace``.

The Mooncake conversation trace is a loaded fleet (~70% of prefill capacity), where a
cache hit is worth a queue. This one asks the opposite question: a burst of requests that
share one long system prompt, each with its own long context after it (RAG, agents), arrives
at a fleet that is otherwise idle. A router that prices a miss by what it costs a loaded
fleet (or one that balances only past an absolute load gap, like sglang-router's
``balance_abs_threshold``) queues the whole burst on the worker that holds the prompt,
while idle workers could take the prompt once and serve the rest of the burst from there.

Each record: ``prefix_blocks`` blocks of one of ``prompts`` system prompts (512 tokens
each), then ``tail_blocks`` blocks no other request shares; bursts of ``burst`` requests
every ``gap_ms``, cycling through the prompts.

    python -m bench.burst_trace --out /tmp/bursts.jsonl --count 24
    python -m bench.routing_quality --trace /tmp/bursts.jsonl --arrival-speedup 2 --limit 384 ...
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import msgspec

from bench.trace import BLOCK, TraceRecord


def bursts(prompts: int = 4, prefix_blocks: int = 8, tail_blocks: int = 4, burst: int = 16,
           count: int = 40, gap_ms: float = 3000.0, output: int = 64, seed: int = 1) -> list[TraceRecord]:
    """``count`` bursts of ``burst`` requests; within a burst arrivals are spread over 50 ms."""
    rng = random.Random(seed)
    next_id = prompts * prefix_blocks  # ids below this are the system prompts' blocks
    out = []
    for b in range(count):
        p = b % prompts
        prefix = list(range(p * prefix_blocks, (p + 1) * prefix_blocks))
        for _ in range(burst):
            tail = list(range(next_id, next_id + tail_blocks))
            next_id += tail_blocks
            out.append(TraceRecord(timestamp=round(b * gap_ms + rng.uniform(0, 50), 3),
                                   input_length=(prefix_blocks + tail_blocks) * BLOCK,
                                   output_length=output, hash_ids=prefix + tail))
    out.sort(key=lambda r: r.timestamp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prefix-blocks", type=int, default=8)
    ap.add_argument("--tail-blocks", type=int, default=4)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=3000.0)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    records = bursts(a.prompts, a.prefix_blocks, a.tail_blocks, a.burst, a.count, a.gap_ms, a.output, a.seed)
    enc = msgspec.json.Encoder()
    a.out.write_bytes(b"".join(enc.encode(r) + b"\n" for r in records))
    print(f"wrote {len(records)} requests in {a.count} bursts to {a.out}")


if __name__ == "__main__":
    main()
