"""Step-time cost model: how long one prefill or decode forward pass takes on the GPU.

Pure functions of token counts, so the scheduler can price a whole step at once instead
of doing per-token work, and tests can check monotonicity without a server.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profiles import Profile


@dataclass(frozen=True, slots=True)
class CostModel:
    profile: Profile

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, host_load_tokens: int = 0) -> float:
        """Seconds for extending ``new_tokens`` after ``cached_tokens`` already in KV.

        Cached tokens are not recomputed but are attended to (the n*c term), which is why
        long cached prefixes are cheap but not free. Host-tier hits are first copied back
        over PCIe (``host_load_tokens``).
        """
        p = self.profile
        n, c = max(new_tokens, 0), max(cached_tokens, 0)
        matmul = 2.0 * p.params * n
        attn = 4.0 * p.n_layers * p.q_dim * (n * c + n * n / 2.0)
        compute = (matmul + attn) / p.tp / p.eff_flops
        load = host_load_tokens * p.kv_bytes_per_token / p.tp / p.host_bw
        weights = p.weight_bytes_per_gpu / p.eff_hbm_bw  # a prefill still streams weights once
        return p.step_overhead_s + max(compute, weights) + load

    def extend_batch_time(self, parts: list[tuple[int, int]], host_load_tokens: int = 0) -> float:
        """One extend step over several requests: ``parts`` = [(new_tokens, cached_tokens)]."""
        p = self.profile
        if not parts:
            return 0.0
        n_total = sum(n for n, _ in parts)
        attn = sum(4.0 * p.n_layers * p.q_dim * (n * c + n * n / 2.0) for n, c in parts)
        compute = (2.0 * p.params * n_total + attn) / p.tp / p.eff_flops
        load = host_load_tokens * p.kv_bytes_per_token / p.tp / p.host_bw
        weights = p.weight_bytes_per_gpu / p.eff_hbm_bw
        return p.step_overhead_s + max(compute, weights) + load

    def decode_step_time(self, batch_size: int, total_context: int) -> float:
        """One decode step for ``batch_size`` requests holding ``total_context`` KV tokens."""
        p = self.profile
        if batch_size <= 0:
            return 0.0
        mem = (p.weight_bytes_per_gpu + total_context * p.kv_bytes_per_token / p.tp) / p.eff_hbm_bw
        compute = (2.0 * p.params * batch_size + 4.0 * p.n_layers * p.q_dim * total_context) / p.tp / p.eff_flops
        return p.step_overhead_s + max(mem, compute)
