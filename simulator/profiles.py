"""Hardware/model cost profiles for the simulator's cost model.

Every number is derived from public specs with roofline reasoning, so a reader can
re-derive or recalibrate it. The cost model (``cost_model.py``) turns them into step times.

Shared derivations:
- H100 SXM: 989 TFLOP/s dense BF16 peak; prefill at large batch reaches ~55% MFU in
  SGLang/vLLM measurements => ~540 TFLOP/s effective. HBM3 3.35 TB/s peak; decode kernels
  reach ~80% => ~2.7 TB/s effective. PCIe Gen5 x16 host<->device ~25 GB/s effective for
  HiCache loads (SGLang's HiCache paper reports 20-30 GB/s per GPU).
- Prefill FLOPs per new token: 2 * params (matmuls) + attention 4 * n_layers * q_dim * ctx
  (QK^T and AV, ctx = the token's position incl. cached prefix).
- Decode step: memory bound; bytes = weights + KV of the whole batch's context.
- Per-step fixed overhead (scheduler, CUDA-graph launch, sampling): ~1 ms on 8B (SGLang
  reports ~6-7 ms ITL at batch 1 for Llama-3-8B on H100 of which weights are ~6 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model_path: str
    params: float  # parameters (whole model)
    tp: int  # tensor-parallel degree: weights/KV split across tp GPUs
    n_layers: int
    q_dim: int  # n_heads * head_dim
    kv_bytes_per_token: int  # whole model, BF16: 2 (K,V) * layers * kv_heads * head_dim * 2 bytes
    eff_flops: float  # effective FLOP/s per GPU for prefill
    eff_hbm_bw: float  # effective bytes/s per GPU for decode
    host_bw: float  # bytes/s host->device (HiCache load)
    step_overhead_s: float  # fixed per forward step (incl. TP all-reduce latency)
    max_total_num_tokens: int  # KV pool capacity in tokens (what SGLang logs at start)
    max_running_requests: int
    chunked_prefill_size: int
    context_length: int

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.params * 2 / self.tp


PROFILES: dict[str, Profile] = {
    # Llama-3.1-8B-Instruct, BF16, 1x H100 80GB, SGLang defaults (mem_fraction_static 0.88).
    # params 8.03e9 -> 16.1 GB weights. KV/token = 2*32 layers*8 kv heads*128*2 B = 131072 B.
    # Pool: 80 GB*0.88 - 16.1 GB weights - ~5 GB activations/graphs ~= 49 GB -> ~370k tokens;
    # SGLang logs max_total_num_tokens ~ 380-450k on this setup, we take 400k.
    # chunked_prefill_size 8192 and max_running_requests 1024 are SGLang's H100 defaults/caps.
    "llama3-8b-h100": Profile(
        name="llama3-8b-h100", model_path="meta-llama/Llama-3.1-8B-Instruct", params=8.03e9, tp=1,
        n_layers=32, q_dim=4096, kv_bytes_per_token=131072, eff_flops=540e12, eff_hbm_bw=2.7e12,
        host_bw=25e9, step_overhead_s=0.001, max_total_num_tokens=400_000, max_running_requests=1024,
        chunked_prefill_size=8192, context_length=131072,
    ),
    # Llama-3.1-70B-Instruct, BF16, 4x H100 80GB (TP4). params 70.6e9 -> 35.3 GB/GPU.
    # KV/token = 2*80 layers*8 kv heads*128*2 B = 327680 B (81920 B/GPU).
    # Pool/GPU: 70.4 GB - 35.3 - ~5 = ~30 GB / 81920 B => ~370k tokens. TP all-reduce adds
    # ~2 ms per step (2 all-reduces per layer x 80 layers over NVLink at small messages).
    "llama3-70b-h100-tp4": Profile(
        name="llama3-70b-h100-tp4", model_path="meta-llama/Llama-3.1-70B-Instruct", params=70.6e9, tp=4,
        n_layers=80, q_dim=8192, kv_bytes_per_token=327680, eff_flops=500e12, eff_hbm_bw=2.6e12,
        host_bw=25e9, step_overhead_s=0.003, max_total_num_tokens=370_000, max_running_requests=1024,
        chunked_prefill_size=8192, context_length=131072,
    ),
    # A deliberately tiny pool, for tests and demos where eviction must happen quickly.
    "tiny-test": Profile(
        name="tiny-test", model_path="sim/tiny", params=8.03e9, tp=1, n_layers=32, q_dim=4096,
        kv_bytes_per_token=131072, eff_flops=540e12, eff_hbm_bw=2.7e12, host_bw=25e9,
        step_overhead_s=0.001, max_total_num_tokens=4096, max_running_requests=64,
        chunked_prefill_size=2048, context_length=32768,
    ),
}

DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name: str, **overrides: object) -> Profile:
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
