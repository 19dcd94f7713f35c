"""Per-decision cost of the cache-aware policies at fleet scale.

Builds a fleet of ``--workers`` workers whose caches hold ``--blocks`` distinct KV blocks
(multi-turn conversations of random tokens, each conversation cached on 1-3 workers in
mixed tiers), each with the engine load it last reported, then times ``Policy.select`` on
follow-up turns: the precise index (KV
events), the approximate radix tree on the same keys, and the cost policy on each. The
precise index places each block in its page trie by the events' token ids (as the KV-event
feed does) and matches a prompt by packing its ids once and comparing them with the trie's
runs; packing is timed alone too, since it grows with prompt length and not with fleet size.
The precise next-turn rows are also split by whether the shared pool holds the prompt (then
every worker can load it, and the policies must weigh that for the whole fleet).
SHA-256 page hashing, which the index needs only for blocks reported without token ids, is
timed alone and as that fallback.
The last rows time ``cost`` with a routing gateway's traffic between decisions (bookings
changing, load reports replaced), and (``--live``) on a saturated fleet: every engine's KV
pool full and N of this gateway's requests running on each worker, so it prices a KV wait
everywhere.

    PYTHONPATH=$PWD python bench/decision_cost.py [--workers 64 --blocks 1000000]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decision_cost_live import event_rows, row, timed, traffic_rows  # noqa: E402
from bench.host import cpu_name, interpreter_ns_per_step  # noqa: E402
from gateway.app import tune_gc  # noqa: E402
from policies.base import EngineLoad, RequestView, WorkerView  # noqa: E402
from index.views import Workers, new_membership  # noqa: E402
from index.block_index import BlockIndex  # noqa: E402
from policies.cache_aware import CacheAware  # noqa: E402
from policies.cost import Cost  # noqa: E402
from index.build import DEFAULT_MAX_INDEX_BLOCKS  # noqa: E402
from policies.kv_events import KvEvents  # noqa: E402
from index.radix import RadixIndex  # noqa: E402
from wire.hashing import page_hashes, uint32_le  # noqa: E402

MEDIUMS = ["GPU", "GPU", "GPU", "CPU_PINNED", "EXTERNAL"]
LAG = 1000  # decisions between a speculative entry and its expiry, in the steady-state row


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def conversation(seed: int, pages: int, page_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(pages * page_size)]


def chat_text(token_ids: list[int]) -> str:
    """A stand-in for the text of a chat request the gateway rendered and tokenized (~5
    characters a token; the text of a prefix is a prefix of the text)."""
    return " ".join(map(str, token_ids))


def fleet(n: int, page_size: int, conversations: int, rng: random.Random
          ) -> tuple[list[WorkerView], dict[int, list[int]]]:
    """``n`` workers, and for each conversation the 1-3 of them holding it. Every worker names
    a KV-event publisher (never subscribed to: the feed is not started), so kv_events matches
    on the precise index instead of falling back to the text tree; and each carries the load
    its engine last reported (/v1/loads), as the gateway polls it for the policies that ask
    (cost does), so every worker's backlog and KV use is priced."""
    info = {"page_size": page_size, "kv_events": {"endpoint": "tcp://127.0.0.1:9"}}
    workers = Workers([WorkerView(f"http://10.0.{i // 250}.{i % 250}:30000", in_flight=rng.randrange(8),
                                  server_info=info,
                                  load=EngineLoad(running=rng.randrange(64), waiting=rng.randrange(4),
                                                  used_tokens=rng.randrange(400_000), max_tokens=400_000,
                                                  timestamp=time.monotonic()))
                       for i in range(n)], new_membership())  # as the gateway's registry hands them over
    return workers, {c: rng.sample(range(n), rng.choice((1, 1, 2, 3))) for c in range(conversations)}


def fill(index, workers: list[WorkerView], owners: dict[int, list[int]], conv_pages: int, page_size: int) -> None:
    """Each conversation's blocks stored on its owners, as BlockStored delivers them (hashes,
    block size and token ids), each owner holding it in one tier (GPU 3 times in 5)."""
    for w in workers:
        index.set_page_size(w.url, page_size)
    for c, holders in owners.items():
        tokens = conversation(c, conv_pages, page_size)
        hashes = page_hashes(tokens, page_size)
        for o in holders:
            index.store(workers[o].url, hashes, None, random.Random(c * 7 + o).choice((0, 0, 0, 1, 2)),
                        page_size, tokens)


def announced(policy, workers: list[WorkerView]):
    """``policy`` told of ``workers`` as the gateway's registry tells it, before any decision."""
    for w in workers:
        policy.on_worker_added(w)
    return policy


def hot_prefix(workers: list[WorkerView], page_size: int, in_flight: int, decisions: int,
               seed: int, policy: str | None = None) -> tuple[list[float], list[float]]:
    """``BlockIndex.match`` (``policy``: a whole ``kv_events`` or ``cost`` decision) through
    a hot system prompt (62 pages) that every worker holds, with ``in_flight`` requests just
    routed (their speculative entries recorded) whose distinct questions follow two template
    pages no engine has reported yet. The entries live in the trie, so a match costs about
    the same however many are in flight; a design that kept them beside the trie and
    compared them one by one read 3.1 ms at 1,000 and 8.9 ms at 3,000 (this row guards
    against that). The prefix every worker holds is one floor for all (``_held_on_path``),
    not an entry per worker: 89 -> 13 us for the match alone, 225 -> 70 for ``cost``."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(62 * page_size)]
    template = [7] * (2 * page_size)
    index = BlockIndex(default_page_size=page_size, speculative_ttl_s=3600)
    for w in workers:
        index.set_page_size(w.url, page_size)
        index.store(w.url, page_hashes(system, page_size), None, 0, page_size, system)

    def request(rid: str) -> RequestView:
        return RequestView(rid, "/generate", token_ids=system + template + [rng.randrange(32_000) for _ in range(300)])

    for i in range(in_flight):
        r = request(f"in{i}")
        index.match(r, workers)
        index.record(r, workers[i % len(workers)])
    fn = index.match
    if policy is not None:  # built as a gateway builds it, on this index
        pol = (KvEvents(speculative_ttl_s=3600) if policy == "kv_events"
               else Cost(index="precise", speculative_ttl_s=3600))
        pol.index.precise = pol.feed.index = index
        announced(pol, workers)
        fn = pol.select
    return timed(fn, [request(f"hot{i}") for i in range(decisions)], workers)


def hot_prefix_approx(workers: list[WorkerView], page_size: int, decisions: int, seed: int
                      ) -> tuple[list[float], list[float]]:
    """``cache_aware`` on the approximate tree through the same hot system prompt, which every
    worker was routed once (so every worker is a tenant of it); each decision is then
    inserted, as in a gateway. A node every candidate holds is one ``everyone`` entry, not
    64 (``RadixIndex.match``)."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(62 * page_size)]
    tail = [7] * (2 * page_size)

    def question() -> list[int]:
        return [rng.randrange(32_000) for _ in range(300)]

    tree = RadixIndex(key="tokens")
    for i, w in enumerate(workers):
        tree.record(RequestView(f"s{i}", "/generate", token_ids=system + question()), w)
    policy = CacheAware(index=tree)
    requests = [RequestView(f"hot{i}", "/generate", token_ids=system + tail + question()) for i in range(decisions)]
    return timed(policy.select, requests, workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--conv-pages", type=int, default=250, help="pages per conversation (turns split it)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tree-budget", type=int, default=1 << 25,
                    help="the radix index's budget in tenant-tokens (max_tree_size; the default holds the "
                         "whole 1M-block fleet, ~30M tenant-tokens, without evicting)")
    ap.add_argument("--live", type=int, nargs="*", default=[32, 256],
                    help="rows for cost on a saturated fleet: requests booked per worker, KV pools full")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="CPython's default collector (default: the gateway's own settings after setup, "
                         "gateway.app.tune_gc: gc.freeze() and a collection every 100k allocations)")
    args = ap.parse_args()
    if any(n < 1 for n in args.live):
        ap.error("--live: at least one request booked per worker")
    ps = args.page_size
    rng = random.Random(args.seed)
    n_conv = max(1, args.blocks // args.conv_pages)
    workers, owners = fleet(args.workers, ps, n_conv, rng)
    info = workers[0].server_info

    # -- precise index: 1M distinct blocks ---------------------------------------------
    gc.collect()
    base = rss_mib()
    t0 = time.perf_counter()
    precise = BlockIndex(speculative_ttl_s=3.0, max_blocks=DEFAULT_MAX_INDEX_BLOCKS)  # the policies' budget
    fill(precise, workers, owners, args.conv_pages, ps)
    build_precise = time.perf_counter() - t0
    gc.collect()
    mem_precise = rss_mib() - base

    # -- approximate radix on the same conversations (token keys), turn by turn --------
    base = rss_mib()
    t0 = time.perf_counter()
    radix = RadixIndex(max_units=args.tree_budget, key="tokens")
    cut = args.conv_pages * ps // args.turns
    for c in range(n_conv):
        tokens = conversation(c, args.conv_pages, ps)
        for o in owners[c]:
            for t in range(1, args.turns + 1):
                radix.record(RequestView(f"b{c}", "/generate", token_ids=tokens[: t * cut]), workers[o])
    build_radix = time.perf_counter() - t0
    gc.collect()
    mem_radix = rss_mib() - base

    # -- requests: the next turn of a random conversation ------------------------------
    def turns(tag: str, chat: bool = False, packed: bool = False) -> list[tuple[RequestView, RequestView]]:
        """(previous turn, next turn) pairs: the next turn is the previous prompt plus an
        answer and a new question (200 new tokens), as in a chat conversation. ``chat``: each
        request also carries a text, as a chat request does once the gateway has rendered and
        tokenized it (``chat_text``), and its ids packed, as the gateway's tokenizer hands them
        over (``wire.prefix_tokens``: a reused prefix is packed already). ``packed``: ids sent
        by the client, as ``gateway.request.read_body`` hands them over."""
        def view(rid: str, ids: list[int]) -> RequestView:
            if packed:  # as read_body hands them over: array("I") and its bytes
                arr = array("I", ids)
                return RequestView(rid, "/generate", token_ids=arr, packed_ids=uint32_le(arr))
            if not chat:
                return RequestView(rid, "/generate", token_ids=ids)
            return RequestView(rid, "/generate", token_ids=ids, text=chat_text(ids), packed_ids=uint32_le(ids))

        out = []
        r = random.Random(args.seed + 99)
        for i in range(args.decisions):
            c = r.randrange(n_conv)
            prev = conversation(c, args.conv_pages, ps)[: r.randrange(1, args.turns + 1) * cut]
            nxt = prev + [r.randrange(32_000) for _ in range(200)]
            out.append((view(f"{tag}{i}p", prev), view(f"{tag}{i}", nxt)))
        return out

    def timed_turns(fn, tag: str, *, warm: bool = True, pairs=None) -> tuple[list[float], list[float]]:
        """Time ``fn`` on next turns (``pairs``, else ``turns(tag)``); with ``warm`` the
        previous turn was routed first (untimed), so its page-hash segments and speculative
        entries exist."""
        wall, cpu = [], []
        for prev, nxt in turns(tag) if pairs is None else pairs:
            if warm:
                fn(prev, workers)
            w, c = timed(fn, [nxt], workers)
            wall += w
            cpu += c
        return wall, cpu

    # (fewer decisions than the row needs, as in a smoke run: the lag shrinks to fit)
    lag = max(1, min(LAG, (args.decisions - 200) // 2))

    def steady_turns(fn, tag: str) -> tuple[list[float], list[float]]:
        """``timed_turns`` in the steady state of a gateway: every decision's speculative
        entries expire ``speculative_ttl_s`` later inside a later decision's match (a few per
        decision), their pages cold in memory by then. The other rows take less than the TTL
        and so expire nothing. Here the queue starts empty and the TTL is set to about
        ``lag`` decisions, so the timed ones each expire about one decision's entries from
        ``lag`` decisions back."""
        precise.expire(now=float("inf"))
        pairs = turns(tag)
        head = min(200, len(pairs) // 4)
        t0 = time.perf_counter()
        for prev, nxt in pairs[:head]:  # the rate, with entries that outlive the row (cleared after)
            fn(prev, workers)
            fn(nxt, workers)
        precise.speculative_ttl_s = (time.perf_counter() - t0) / max(1, head) * lag
        for prev, nxt in pairs[head:head + lag]:
            fn(prev, workers)
            fn(nxt, workers)
        wall, cpu = timed_turns(fn, tag, pairs=pairs[head + lag:])
        precise.speculative_ttl_s = 3.0
        precise.expire(now=float("inf"))
        return wall, cpu

    def pool_split(name: str, times: tuple[list[float], list[float]], tag: str) -> list[str]:
        """The row, then split by whether the shared pool holds the prompt's leading pages
        (about a third of the fleet's conversations): every worker can load those, so the
        match gives every worker a prefix (``IndexMatch.everyone``, or each worker listed
        with it where page sizes differ)."""
        matches = [precise.match(nxt, workers) for _, nxt in turns(tag)]
        pooled = [bool(m.everyone.pool or any(t.pool for t in m.hits.values())) for m in matches]
        out = [row(name, times)]
        for label, want in (("prompt in the shared pool", True), ("not in the pool", False)):
            pick = [i for i, p in enumerate(pooled) if p == want]
            if pick:  # (a small fleet may have no conversation in the pool)
                out.append(row(f"{name}, {label}", ([times[0][i] for i in pick], [times[1][i] for i in pick])))
        return out

    kv = KvEvents(speculative_ttl_s=3.0)
    kv.index.precise = precise  # the 1M-block index built above
    kv.feed.index = precise
    ca = CacheAware(index=radix)
    cost_precise = Cost(index=precise)
    cost_approx = Cost(index=radix)
    for pol in (kv, ca, cost_precise, cost_approx):
        announced(pol, workers)

    if not args.no_gc_freeze:
        tune_gc()
    results = []
    reqs = [nxt for _, nxt in turns("w")]
    results.append(row("precise index match (BlockIndex.match: pack the ids, walk the trie)",
                       timed(precise.match, reqs, workers)))
    # The same requests again, each after all the others: what a held request costs when the
    # gateway decides it again (the index left its packed ids on it the first time).
    results.append(row("precise index match again, others matched in between (a held request decided again)",
                       timed(precise.match, reqs, workers)))
    reqs = [nxt for _, nxt in turns("w")]  # the same prompts, not packed yet (as a first decision)
    results.append(row("approx index walk (RadixIndex.match)", timed(radix.match, reqs, workers)))
    del reqs  # (their packed ids, ~30 MB, left alive made the first select row below read ~40% slower)
    gc.collect()
    # Untimed first: the first select row run twice read 80 then 60 us (the process's first
    # decisions pay one-off costs, and a gateway in service has paid them); their entries expire.
    for prev, nxt in turns("u")[:500]:
        kv.select(prev, workers)
        kv.select(nxt, workers)
    precise.expire(now=float("inf"))
    results += pool_split("kv_events select, next turn", timed_turns(kv.select, "k"), "k")
    results.append(row(f"kv_events select, next turn, each decision expiring the speculative entries of one "
                       f"{lag} decisions back (steady state)", steady_turns(kv.select, "e")))
    precise.expire(now=float("inf"))  # the rows below start without entries waiting to expire
    results.append(row("kv_events select, next turn, chat request (its text and packed ids beside the ids)",
                       timed_turns(kv.select, "t", pairs=turns("t", chat=True))))
    precise.expire(now=float("inf"))
    results += pool_split("cost select, precise index, next turn", timed_turns(cost_precise.select, "c"), "c")
    precise.expire(now=float("inf"))
    results.append(row("cost select, precise index, next turn, chat request (its text and packed ids beside the ids)",
                       timed_turns(cost_precise.select, "q", pairs=turns("q", chat=True))))
    precise.expire(now=float("inf"))
    results.append(row("cost select, precise index, next turn, ids sent by the client, packed by the gateway "
                       "(read_body)", timed_turns(cost_precise.select, "g", pairs=turns("g", packed=True))))
    precise.expire(now=float("inf"))
    results.append(row("kv_events select, first sight of a prompt", timed_turns(kv.select, "f", warm=False)))
    results.append(row("cache_aware select, approx index (match + insert)", timed_turns(ca.select, "a")))
    results.append(row("cost select, approx index (match + insert)", timed_turns(cost_approx.select, "d")))
    results.append(row("cost select, approx index, chat request (its text and packed ids beside the ids)",
                       timed_turns(cost_approx.select, "x", pairs=turns("x", chat=True))))
    # One block reported without token ids is enough to turn on the SHA fallback for every walk.
    precise.expire(now=float("inf"))
    precise.store(workers[0].url, [12345], None, 0, ps)
    results.append(row("kv_events select, next turn, SHA fallback on (a block known by hash only)",
                       timed_turns(kv.select, "s")))
    precise.remove(workers[0].url, [12345])
    hash_reqs = [nxt for _, nxt in turns("h")]
    for in_flight in (0, 3000):
        results.append(row(f"precise index match through a hot prefix every worker holds, {in_flight:,} requests "
                           "in flight past it (speculative entries)",
                           hot_prefix(workers, ps, in_flight, args.decisions, args.seed + in_flight)))
    for name in ("kv_events", "cost"):
        results.append(row(f"{name} select through a hot prefix every worker holds, 3,000 requests in flight past it",
                           hot_prefix(workers, ps, 3000, args.decisions, args.seed + 1, policy=name)))
    results.append(row("cache_aware select, approx index, through a hot prefix every worker holds",
                       hot_prefix_approx(workers, ps, args.decisions, args.seed + 2)))
    results.append(row("packing the ids alone, full prompt (wire.hashing.uint32_le)",
                       timed(lambda r, _w: uint32_le(r.token_ids), hash_reqs, workers)))
    hash_us = timed(lambda r, _w: page_hashes(r.token_ids, ps), hash_reqs, workers)
    results.append(row("page hashing alone, full prompt (wire.hashing.page_hashes)", hash_us))

    results += event_rows(precise, workers, lambda c: conversation(c, args.conv_pages, ps)[:cut], n_conv,
                          args.decisions, ps, args.seed + 7)
    results += traffic_rows(radix, workers, info, turns, args.seed, args.live)
    avg_tokens = statistics.mean(len(r.token_ids) for r in hash_reqs)
    reused = precise.chains.pages_reused / max(precise.chains.pages_reused + precise.chains.pages_hashed, 1)

    print(f"# Routing decision cost ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC})")
    print(f"machine: {cpu_name()}, {platform.system()} {platform.release()}, Python {platform.python_version()}, "
          f"{interpreter_ns_per_step():.0f} ns per step of a plain Python loop (bench.host.interpreter_ns_per_step)")
    print(f"command: PYTHONPATH=$PWD python {' '.join(sys.argv)}")
    print(f"gc: {'CPython default' if args.no_gc_freeze else 'the gateway settings after setup (tune_gc)'}; "
          f"load average at end: {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")
    print(f"fleet: {args.workers} workers, {len(precise._holders.keys() | precise.pool):,} "
          f"distinct blocks (page {ps}; {len(precise.pool):,} in the shared pool), "
          f"{n_conv} conversations x {args.turns} turns, prompts avg {avg_tokens:.0f} tokens")
    print(f"precise index: {mem_precise:.0f} MiB RSS, built in {build_precise:.1f} s; "
          f"radix index: {mem_radix:.0f} MiB RSS, {radix.nodes:,} nodes, {radix.units:,} tenant-tokens "
          f"of its {radix.max_units:,} budget ({radix.evicted_units:,} evicted), "
          f"built in {build_radix:.1f} s; SHA fallback: page-hash cache reused {reused:.0%} of pages")
    print()
    print("| path | decisions | CPU median us | CPU p99 us | wall median us | wall p99 us |")
    print("|---|---|---|---|---|---|")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
