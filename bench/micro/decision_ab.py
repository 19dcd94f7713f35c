"""Decision cost of this tree's policies against another commit's, interleaved in one process.

On a shared VM whole runs of ``bench/decision_cost.py`` drift by tens of percent within
minutes (``bench.host.interpreter_ns_per_step`` moves with them), more than most changes
to a policy are worth. Here the other commit's ``policies/`` and ``index/`` packages are loaded beside
this tree's (extracted with ``git archive`` as ``policies_ref`` and ``index_ref``), each builds its own
precise index over the same fleet, and every next turn is timed on both, one right after
the other in alternating order, so drift hits both alike. ``wire/`` and ``gateway/`` are
this tree's for both.

    PYTHONPATH=$PWD python bench/micro/decision_ab.py --ref HEAD~1 --policy kv_events
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.decision_cost import chat_text, conversation, fill, fleet  # noqa: E402
from bench.host import cpu_name, interpreter_ns_per_step  # noqa: E402
from gateway.app import tune_gc  # noqa: E402
from policies.base import RequestView  # noqa: E402


def load_ref(commit: str, into: Path) -> str:
    """``policies/`` (and ``index/``, where the commit has it) at ``commit`` as the packages
    ``policies_ref`` and ``index_ref`` under ``into``."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", commit], check=True,
                           capture_output=True, text=True).stdout.split()
    layers = [name for name in ("policies", "index") if name in names]
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *layers], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    for layer in layers:
        (into / layer).rename(into / f"{layer}_ref")
    for layer in layers:
        for path in (into / f"{layer}_ref").glob("*.py"):
            path.write_text(re.sub(r"\b(from|import) (policies|index)\.", r"\1 \2_ref.", path.read_text()))
    sys.path.insert(0, str(into))
    return "policies_ref"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="the commit to compare with (default HEAD: this tree's changes)")
    ap.add_argument("--policy", choices=["kv_events", "cost"], default="kv_events")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prebuilt", action="store_true",
                    help="build every prompt before timing, as decision_cost does (default: each one between "
                         "two decisions, ~4,000 fresh ints, so a decision starts with colder caches, as in a "
                         "gateway that parses and proxies between decisions)")
    ap.add_argument("--speculative-ttl", type=float, default=3.0,
                    help="seconds a decision's speculative entry lives; below the run's length (~0.5) every "
                         "decision also expires about one entry, as in a gateway's steady state")
    ap.add_argument("--chat", action="store_true",
                    help="requests carry their text beside the token ids, as a chat request does once the "
                         "gateway has rendered and tokenized it (default: ids only, as /generate)")
    args = ap.parse_args()
    ps, conv_pages, turns = 16, 250, 5
    rng = random.Random(args.seed)
    n_conv = max(1, args.blocks // conv_pages)
    workers, owners = fleet(args.workers, ps, n_conv, rng)

    def policy(package: str):
        """The policy on its own precise index, filled as decision_cost fills its."""
        # with the memory budget the policies build it with, where that code has one
        # the index layer beside the policies, or inside them in a commit from before it had its own
        layer = package.replace("policies", "index")
        if importlib.util.find_spec(layer) is None:
            layer = package
        where = layer + ".build" if importlib.util.find_spec(layer + ".build") else package + ".kv_events"
        budget = getattr(importlib.import_module(where), "DEFAULT_MAX_INDEX_BLOCKS", None)
        extra = {} if budget is None else {"max_blocks": budget}
        index = importlib.import_module(layer + ".block_index").BlockIndex(speculative_ttl_s=args.speculative_ttl,
                                                                             **extra)
        fill(index, workers, owners, conv_pages, ps)
        # as a gateway builds them: the precise index behind its text fallback, fed by KV events
        if args.policy == "cost":
            pol = importlib.import_module(package + ".cost").Cost(index="precise",
                                                                  speculative_ttl_s=args.speculative_ttl)
        else:
            pol = importlib.import_module(package + ".kv_events").KvEvents(speculative_ttl_s=args.speculative_ttl)
        pol.index.precise = pol.feed.index = index
        for w in workers:  # announced, as the gateway's registry does before any decision
            pol.on_worker_added(w)
        return pol

    with tempfile.TemporaryDirectory() as tmp:
        ours, ref = policy("policies"), policy(load_ref(args.ref, Path(tmp)))
        cut = conv_pages * ps // turns
        r = random.Random(args.seed + 99)
        tune_gc()
        clock = time.thread_time_ns
        times: dict[str, list[float]] = {"this tree": [], args.ref: []}

        def text(tokens: list[int]) -> str | None:
            return chat_text(tokens) if args.chat else None

        def next_turns():
            for _ in range(args.decisions):
                c = r.randrange(n_conv)
                prev = conversation(c, conv_pages, ps)[: r.randrange(1, turns + 1) * cut]
                yield prev, prev + [r.randrange(32_000) for _ in range(200)]

        for i, (prev, nxt) in enumerate(list(next_turns()) if args.prebuilt else next_turns()):
            pair = [(ours, times["this tree"]), (ref, times[args.ref])]
            for pol, out in pair if i % 2 else pair[::-1]:
                pol.select(RequestView(f"p{i}", "/generate", token_ids=prev, text=text(prev)),
                           workers)  # the previous turn, untimed
                request = RequestView(f"n{i}", "/generate", token_ids=nxt, text=text(nxt))
                t0 = clock()
                pol.select(request, workers)
                out.append((clock() - t0) / 1000)

    def p99(us: list[float]) -> float:
        return sorted(us)[min(len(us) - 1, int(len(us) * 0.99))]

    mine, theirs = times["this tree"], times[args.ref]
    print(f"# {args.policy} next turn, this tree vs {args.ref}, interleaved")
    print(f"machine: {cpu_name()}, {interpreter_ns_per_step():.0f} ns per step of a plain Python loop")
    print(f"command: PYTHONPATH=$PWD python {' '.join(sys.argv)}")
    print(f"fleet: {args.workers} workers, ~{args.blocks:,} blocks, two indexes in one process "
          "(cache pressure makes both slower than decision_cost's one: compare the ratio); prompts "
          f"{'built before timing' if args.prebuilt else 'built between decisions'}; speculative entries live "
          f"{args.speculative_ttl:g} s; {'chat requests (text and ids)' if args.chat else 'ids only'}")
    print()
    print("| code | decisions | CPU median us | CPU p99 us |")
    print("|---|---|---|---|")
    for name, us in times.items():
        print(f"| {name} | {len(us)} | {statistics.median(us):.1f} | {p99(us):.1f} |")
    diffs = [a - b for a, b in zip(mine, theirs)]
    print(f"\nthis tree / {args.ref}: {statistics.median(mine) / statistics.median(theirs):.3f} of the median; "
          f"per decision, median difference {statistics.median(diffs):+.2f} us")


if __name__ == "__main__":
    main()
