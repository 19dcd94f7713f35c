"""What reusing a recent prompt's prefix ids saves the gateway's tokenizer, on the Mooncake trace.

With ``--tokenizer DIR`` the gateway tokenizes every chat for the precise index, and every
turn of a conversation re-sends its whole history. ``wire.prefix_tokens`` encodes only what
a prompt adds after the deepest special token it shares with a recent one. This replays the
trace's requests in order through two tokenizers built from the same model directory, one
reusing (``--budget-mb``, the gateway's default 64) and one encoding every prompt whole, and
checks that both give the same ids for every request.

Chats are built from the trace's hash ids: each 512-token block becomes one message (roles
alternating, the block's deterministic text from ``bench.trace.block_text``), so requests
that share leading blocks share leading messages, as the trace's conversations share their
history. The tokenizer is ``simulator.tiny_tokenizer``'s byte-level BPE with the Llama 3
template (~1 us per token here; a large-vocabulary model's is faster per character, so the
absolute savings are smaller in proportion, the ratio similar).

``--chats N --turns T`` replaces the trace with N synthetic conversations of T turns, sent
round robin (turn t of every chat, then turn t + 1): each turn is the last one's messages plus
an answer and a new question (one block each), as a chat application sends them.

    PYTHONPATH=$PWD python bench/micro/tokenize_reuse.py [--limit 800 --budget-mb 64 --template llama3]
    PYTHONPATH=$PWD python bench/micro/tokenize_reuse.py --chats 50 --turns 20
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import cpu_name  # noqa: E402
from bench.trace import DEFAULT_TRACE, TraceRecord, block_text, load_trace  # noqa: E402
from simulator.tiny_tokenizer import build  # noqa: E402
from wire.tokenizer import HFTokenizer  # noqa: E402


def chat(hash_ids: list[int]) -> list[dict[str, str]]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": block_text(h)} for i, h in enumerate(hash_ids)]


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=800)
    ap.add_argument("--budget-mb", type=float, default=64)
    ap.add_argument("--template", default="llama3", choices=("llama3", "chatml"))
    ap.add_argument("--chats", type=int, default=0, help="synthetic conversations instead of the trace")
    ap.add_argument("--turns", type=int, default=20)
    args = ap.parse_args()

    if args.chats:
        records = [TraceRecord(0, 0, 0, [c * 10_000 + b for b in range(2 * t + 1)])
                   for t in range(args.turns) for c in range(args.chats)]
    else:
        records = load_trace(args.trace, args.limit)
    seen: set[tuple[int, ...]] = set()  # the bound: blocks shared with any earlier request, no budget
    shared = blocks = 0
    for r in records:
        prefixes = [tuple(r.hash_ids[:n]) for n in range(1, len(r.hash_ids) + 1)]
        shared += sum(p in seen for p in prefixes)
        blocks += len(prefixes)
        seen.update(prefixes)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "model", args.template)
        reusing = HFTokenizer(str(model), reuse_bytes=int(args.budget_mb * (1 << 20)))
        whole = HFTokenizer(str(model), reuse_bytes=0)
    clock = time.thread_time
    times: dict[str, list[float]] = {"reuse": [], "whole": []}
    tokens = 0
    for n, r in enumerate(records):
        prompt = reusing.render_chat(chat(r.hash_ids))
        order = (("reuse", reusing), ("whole", whole)) if n % 2 else (("whole", whole), ("reuse", reusing))
        got = {}
        for name, tok in order:
            t0 = clock()
            got[name] = tok.encode_chat(prompt)
            times[name].append((clock() - t0) * 1e3)
        if got["reuse"] != got["whole"]:
            raise SystemExit(f"request {n}: reused ids differ from the whole encoding")
        tokens += len(got["whole"])
    stats = reusing.reuse.stats() if reusing.reuse else {}

    print(f"- machine: {cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f}")
    source = f"--chats {args.chats} --turns {args.turns}" if args.chats else f"--limit {args.limit}"
    print(f"- command: `PYTHONPATH=$PWD python bench/micro/tokenize_reuse.py {source} "
          f"--budget-mb {args.budget_mb:g} --template {args.template}`")
    print(f"- {len(records)} requests, {tokens:,} prompt tokens ({tokens / len(records):,.0f} a request); "
          f"every request's ids identical both ways")
    print(f"- reuse: {stats.get('tokenize_prefix_reused_tokens_total', 0) / tokens:.1%} of prompt tokens reused, "
          f"{stats.get('tokenize_prefix_reuses_total', 0):.0f} reuses / "
          f"{stats.get('tokenize_prefix_misses_total', 0):.0f} misses, "
          f"{stats.get('tokenize_prefix_verified_total', 0):.0f} also encoded whole to check, "
          f"{stats.get('tokenize_prefix_entries', 0):.0f} entries, "
          f"{stats.get('tokenize_prefix_bytes', 0) / (1 << 20):.1f} MiB at the end")
    print(f"- bound: {shared / blocks:.1%} of the blocks (messages here) extend a prefix an earlier request "
          f"sent (every earlier request kept, no budget)\n")
    print("| tokenizer | total CPU s | mean ms | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|")
    for name, label in (("whole", "whole prompt every time"), ("reuse", "prefix reuse (wire.prefix_tokens)")):
        v = times[name]
        print(f"| {label} | {sum(v) / 1e3:.2f} | {statistics.fmean(v):.2f} | {statistics.median(v):.2f} | "
              f"{_pct(v, 0.9):.2f} | {_pct(v, 0.99):.2f} | {max(v):.2f} |")
    w, r = times["whole"], times["reuse"]
    print(f"\nreuse / whole: total CPU {sum(r) / sum(w):.3f}, mean {statistics.fmean(r) / statistics.fmean(w):.3f}, "
          f"p50 {statistics.median(r) / statistics.median(w):.3f}, p99 {_pct(r, 0.99) / _pct(w, 0.99):.3f}")


if __name__ == "__main__":
    main()
