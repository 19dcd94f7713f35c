"""``pd_cost``: choose a prefill/decode pair as one decision.

Picking the best prefill and the best decode separately ignores what joins them: the
prompt's KV has to cross from one to the other. This policy prices a pair as

    ttft(p, d) = cost's prediction for prefill p (its backlog, this prompt's uncached
                 tokens after tier credit)
               + prompt tokens * kv_bytes_per_token / bandwidth(p, d)
               + decode d's load (running and waiting requests * decode_cost_s)

where ``bandwidth`` is ``same_host_bytes_per_s`` when both legs share a host (NVLink or
intra-node RDMA) and ``cross_host_bytes_per_s`` otherwise (the RDMA NIC, or TCP). So a long
prompt whose prefix sits on one prefill is sent there, and its decode leg stays on the same
host unless that host's decode is busy enough to cost more than the slower transfer.

Defaults: 128 KiB of KV per token (Llama-3-8B BF16), 150 GB/s within a host, 25 GB/s (one
200 Gb/s NIC) across hosts. As a plain policy (``select``) it is ``cost``.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass

from policies.base import Choice, Hold, RequestView, WorkerView, opt, require_workers
from policies.cost import Cost, CostOptions


@dataclass
class PDCostOptions(CostOptions):
    kv_bytes_per_token: float = opt(131072.0, "KV bytes per prompt token moved prefill -> decode")
    same_host_bytes_per_s: float = opt(150e9, "transfer bandwidth when both legs share a host")
    cross_host_bytes_per_s: float = opt(25e9, "transfer bandwidth across hosts (the RDMA NIC)")
    hold_wait_s: float = opt(0.0, "late binding on the prefill queue (0: never hold)")
    demand_window_s: float = opt(0.0, "share a prefill copy's work charge with recent requests for its prefix "
                                 "(0: never; see cost)")


class PDCost(Cost):
    name = "pd_cost"
    Options = PDCostOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        o = self.opts
        self.kv_bytes_per_token = o.kv_bytes_per_token
        self.same_host_bps = o.same_host_bytes_per_s
        self.cross_host_bps = o.cross_host_bytes_per_s

    def decode_wait(self, worker: WorkerView) -> float:
        load = worker.load
        queued = max(worker.in_flight, (load.running + load.waiting) if load else 0)
        return queued * self.pricer.decode_cost_s

    def transfer_s(self, prompt_tokens: float, prefill: WorkerView, decode: WorkerView) -> float:
        bw = self.same_host_bps if prefill.host == decode.host else self.cross_host_bps
        return prompt_tokens * self.kv_bytes_per_token / bw

    def select_pair(self, request: RequestView, prefills: Sequence[WorkerView],
                    decodes: Sequence[WorkerView]) -> tuple[Choice, Choice] | Hold:
        require_workers(prefills)
        require_workers(decodes)
        prompt = float(request.prompt_tokens_estimate)
        b = self.backlogs(request, prefills)
        costs, scores = self.pricer.price(b)
        waits = [self.decode_wait(d) for d in decodes]
        best: tuple[float, int, int] | None = None
        for i, p in enumerate(prefills):
            for j, d in enumerate(decodes):
                total = scores[i] + self.transfer_s(prompt, p, d) + waits[j]
                if best is None or total < best[0]:
                    best = (total, i, j)
        assert best is not None
        total, i, j = best
        prefill_choice = self.decide(request, prefills[i], costs[i], b)  # held on the prefill's queue, as in ``cost``
        if isinstance(prefill_choice, Hold):
            return prefill_choice
        prefill_choice.reason = f"pair {total * 1000:.1f}ms"
        return prefill_choice, Choice(decodes[j], reason=f"pair {total * 1000:.1f}ms")
