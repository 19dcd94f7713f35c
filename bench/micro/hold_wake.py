"""What late binding costs the gateway when many requests are held.

Held requests are decided again when the fleet changes: a routed request's first token or
its end (``gateway.hold``). This drives the gateway's own hold path (``Attempts.choose`` and
its ``HoldRoom``, no HTTP) with the real ``cost`` policy over a saturated fleet: ``--held``
requests wait while every worker has more than ``hold_wait_s`` of prefill booked, and each
event is one routed request's first token, which frees its prefill on its worker (so one
held request can usually go there). It counts the policy decisions each event costs and
the gateway CPU they take, for every wake mode of the room side by side:

- ``all``: every held request is decided again at every event;
- ``N``: the N decided least recently are, plus one more for each that goes to a worker.

It also counts order inversions: held requests that went to a worker before one that
arrived earlier. Every request here is the same size, so whichever is decided first when
room frees takes it; a request held again goes to the back of the line, so some are
expected with ``N``.

    PYTHONPATH=$PWD python -m bench.micro.hold_wake [--held 10 100 1000] [--workers 64] [--wake all 4]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import time

from bench.host import cpu_name
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from policies.base import Choice, RequestView, WorkerView
from policies.cost import Cost

PROMPT_TOKENS = 4000  # ~0.16 s of prefill at cost's default 25k tokens/s: over hold_wait_s


def _request(i: int) -> RequestView:
    return RequestView(f"r{i}", "/generate", token_ids=[i] * PROMPT_TOKENS, max_tokens=64)


async def scenario(held: int, workers: int, events: int, wake: int) -> dict[str, float]:
    """``events`` first tokens into a fleet holding ``held`` requests; decisions and CPU per event."""
    policy = Cost(index="approx", hold_wait_s=0.1, hold_patience=1e9)
    fleet = [WorkerView(f"http://10.0.0.{i}:30000") for i in range(workers)]
    proxy = Proxy(None, policy, None, GatewayMetrics(), max_retries=0, max_hold_s=3600,  # type: ignore[arg-type]
                  hold_wake=wake)
    decisions = 0
    routed: list[RequestView] = []
    left: list[int] = []  # held requests in the order they went to a worker, by arrival

    async def route(view: RequestView, index: int) -> None:
        async def decide(asked: RequestView):  # the view as the hold loop replaced it
            nonlocal decisions
            decisions += 1
            return policy.select(asked, fleet)

        choice, view = await proxy.attempts.choose(view, decide, first=True)
        assert isinstance(choice, Choice)
        policy.on_routed(view, choice.worker)
        routed.append(view)
        if index >= 0:
            left.append(index)

    async def settle() -> None:
        """Run the loop until woken requests stop deciding (a wake takes a few loop steps
        to reach its waiter), bounded by the number held."""
        quiet, last = 0, -1
        for _ in range(held + 20):
            await asyncio.sleep(0)
            quiet, last = (quiet + 1, last) if decisions == last else (0, decisions)
            if quiet >= 5:
                return

    # Saturate: one request's prefill booked per worker, so every worker's wait is over
    # hold_wait_s until that request's first token, and then one held request fits there.
    for i in range(workers):
        await route(_request(i), -1)
    tasks = [asyncio.create_task(route(_request(10_000 + i), i)) for i in range(held)]
    await asyncio.sleep(0)  # every one of them decides once and is held
    assert proxy.holds.held == held, proxy.holds.held
    decisions = 0
    cpu0 = time.thread_time()
    for _ in range(events):
        done = routed.pop(0)  # the oldest routed request reaches its first token
        policy.on_first_token(done, fleet[0])
        proxy.attempts.freed()
        await settle()
        for _ in range(held):  # steady state: a new request is held for each that left
            if proxy.holds.held >= held:
                break
            tasks.append(asyncio.create_task(route(_request(20_000 + len(tasks)), held + len(tasks))))
            await settle()
    cpu = time.thread_time() - cpu0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    inversions = sum(1 for a, b in zip(left, left[1:]) if b < a)
    return {"decisions": decisions / events, "cpu_us": cpu / events * 1e6, "left": len(left),
            "inversions": inversions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--held", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--wake", nargs="+", default=["all", "16", "4"],
                    help="'all' or how many held requests an event wakes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is reported")
    args = ap.parse_args()
    rows = []
    for held in args.held:
        for wake in args.wake:
            n = 0 if wake == "all" else int(wake)
            runs = [asyncio.run(scenario(held, args.workers, args.events, n)) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((held, wake, med))
    print(f"# Late binding: decisions per event ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC})")
    print(f"machine: {cpu_name()}, {platform.system()} {platform.release()}, Python {platform.python_version()}")
    print(f"command: PYTHONPATH=$PWD python -m bench.micro.hold_wake {' '.join(sys.argv[1:])}")
    print(f"fleet: {args.workers} workers, saturated; {args.events} events per run, median of {args.repeat} runs")
    print()
    print("| held | wake | decisions per event | gateway CPU per event us | requests that left | order inversions |")
    print("|---|---|---|---|---|---|")
    for held, wake, m in rows:
        print(f"| {held} | {wake} | {m['decisions']:.1f} | {m['cpu_us']:.0f} | {m['left']:.0f} | {m['inversions']:.0f} |")


if __name__ == "__main__":
    main()
