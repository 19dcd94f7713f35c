"""What reading a request body costs the gateway, typed one-prompt decoding against the
general path alone (every body decoded loosely, ids checked in Python), interleaved in one
process so the machine's drift hits both alike. A second table: bodies whose ids a client
sends turn after turn (an RL rollout), read with a recent list's prefix (``read_body`` with
``wire.prefix_ids``) against decoding them whole and packing them as the index then must.

    PYTHONPATH=$PWD python bench/micro/parse_body.py [--rounds 2000]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gateway.request as request  # noqa: E402
from bench.host import cpu_name, interpreter_ns_per_step  # noqa: E402
from gateway.request import CHAT, COMPLETIONS, GENERATE, parse_body, read_body  # noqa: E402
from wire.hashing import uint32_le  # noqa: E402
from wire.prefix_ids import RecentIds  # noqa: E402


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
        ("/v1/chat/completions, the same with prompt_cache_key and user", CHAT,
         json.dumps({"model": "m", "messages": turns, "max_tokens": 64, "stream": True,
                     "prompt_cache_key": "conversation-0123456789", "user": "user-42"}).encode()),
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
    print()
    print("Ids a client sends turn after turn: read and packed (uint32 LE) as the index needs them")
    print()
    print("| body | bytes | decoded whole, then packed | read_body with recent lists | ratio |")
    print("|---|---|---|---|---|")
    for name, prev, raw in rollout_cases(random.Random(2)):
        times = {"whole": [], "recent": []}
        recent = RecentIds()
        for k in range(args.rounds):
            if prev is not None:
                read_body(prev, GENERATE, recent)  # the turn before, read as the gateway read it
            else:  # first sight: a warm cache of other rollouts, none this one's
                recent = RecentIds()
                for other in warm:
                    read_body(other, GENERATE, recent)
            for label in (("whole", "recent") if k % 2 else ("recent", "whole")):
                t0 = time.perf_counter_ns()
                if label == "whole":
                    uint32_le(parse_body(raw, GENERATE).input_ids)
                else:
                    read_body(raw, GENERATE, recent)
                times[label].append((time.perf_counter_ns() - t0) / 1000)
        w, r = statistics.median(times["whole"]), statistics.median(times["recent"])
        print(f"| {name} | {len(raw):,} | {w:.1f} | {r:.1f} | {r / w:.2f} |")


def _ids_body(ids: list[int]) -> bytes:
    return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 256, "temperature": 1.0}}).encode()


def rollout_cases(rng: random.Random) -> list[tuple[str, bytes | None, bytes]]:
    """(row, the body of the turn before or None, the body timed)."""
    def ids(n: int) -> list[int]:
        return [rng.randrange(150_000) for _ in range(n)]

    out = []
    for n, add in ((2_400, 200), (15_500, 500)):
        prev = ids(n)
        out.append((f"next turn: {n:,} ids sent before, {add} more", _ids_body(prev), _ids_body(prev + ids(add))))
    same = ids(2_600)
    out.append(("the same 2,600 ids again (a GRPO group's next sample)", _ids_body(same), _ids_body(same)))
    out.append(("first sight: 2,600 ids, 16 other rollouts kept", None, _ids_body(ids(2_600))))
    return out


warm = [_ids_body([random.Random(i).randrange(150_000) for _ in range(2_600)]) for i in range(16)]


if __name__ == "__main__":
    main()
