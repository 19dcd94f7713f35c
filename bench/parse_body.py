"""What reading a request body costs the gateway, typed one-prompt decoding against the
general path alone (every body decoded loosely, ids checked in Python), interleaved in one
process so the machine's drift hits both alike.

    PYTHONPATH=$PWD python bench/parse_body.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gateway.request as request  # noqa: E402
from bench.host import cpu_name, interpreter_ns_per_step  # noqa: E402
from gateway.request import CHAT, COMPLETIONS, GENERATE, parse_body  # noqa: E402


class _General:
    """The typed decoder refused: the general path alone, as before ``_SingleBody``."""

    def decode(self, raw: bytes) -> None:
        raise msgspec.ValidationError("refused")


def cases(rng: random.Random) -> list[tuple[str, str, bytes]]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(128_000) for _ in range(n)]

    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 400} for i in range(8)]
    return [
        ("/generate, input_ids, 2,600 ids", GENERATE,
         json.dumps({"input_ids": ids(2600), "sampling_params": {"max_new_tokens": 64}, "stream": True}).encode()),
        ("/generate, input_ids, 16,000 ids", GENERATE,
         json.dumps({"input_ids": ids(16_000), "sampling_params": {"max_new_tokens": 64}}).encode()),
        ("/v1/completions, prompt as 2,600 ids", COMPLETIONS,
         json.dumps({"model": "m", "prompt": ids(2600), "max_tokens": 64}).encode()),
        ("/generate, a batch of 4 x 650 ids", GENERATE,
         json.dumps({"input_ids": [ids(650) for _ in range(4)], "sampling_params": {"max_new_tokens": 64}}).encode()),
        ("/v1/chat/completions, 8 messages, ~16 KB", CHAT,
         json.dumps({"model": "m", "messages": turns, "max_tokens": 64, "stream": True}).encode()),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    typed, general = request._single, _General()
    rows = []
    for name, route, raw in cases(random.Random(1)):
        times: dict[str, list[float]] = {"typed": [], "general": []}
        for k in range(args.rounds):
            order = (("typed", typed), ("general", general)) if k % 2 else (("general", general), ("typed", typed))
            for label, decoder in order:
                request._single = decoder
                t0 = time.perf_counter_ns()
                parse_body(raw, route)
                times[label].append((time.perf_counter_ns() - t0) / 1000)
        request._single = typed
        t, g = statistics.median(times["typed"]), statistics.median(times["general"])
        rows.append((name, len(raw), t, g))
    print(f"# Parsing a request body ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC})")
    print(f"machine: {cpu_name()}, {platform.system()} {platform.release()}, Python {platform.python_version()}, "
          f"{interpreter_ns_per_step():.0f} ns per step of a plain Python loop")
    print(f"command: PYTHONPATH=$PWD python {' '.join(sys.argv)}  (msgspec {msgspec.__version__}; "
          f"{args.rounds} rounds, interleaved; wall median us)")
    print()
    print("| body | bytes | typed one-prompt path | general path alone | ratio |")
    print("|---|---|---|---|---|")
    for name, size, t, g in rows:
        print(f"| {name} | {size:,} | {t:.1f} | {g:.1f} | {t / g:.2f} |")


if __name__ == "__main__":
    main()
