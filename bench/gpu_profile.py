"""Check the simulator's cost model against a real GPU.

``simulator/profiles.py`` derives every step time from public specs (effective FLOP/s for
prefill, effective HBM bandwidth for decode, PCIe bandwidth for HiCache loads). The routing
benchmarks, and the cost policy's tier credits, are only as good as those numbers. This
script measures the same quantities on the GPU it runs on, with a model of the profile's
shape (random weights: timing does not depend on their values) and PyTorch's own kernels,
and prints them beside what ``simulator.cost_model`` predicts:

- prefill: one forward pass of ``n`` new tokens (``logits_to_keep=1``, as an engine samples
  only the last position), alone and after a cached prefix; and the attention term by
  itself on the flash and cuDNN kernels (the model's ``n*c + n*n/2`` term);
- decode: the two halves of a step, measured apart and captured in CUDA graphs so launch
  overhead does not count: every weight matrix multiplied by a batch of ``b`` tokens (what
  streams the weights), and attention of ``b`` one-token queries over their KV;
- host <-> device copies from pinned memory, in bulk and in KV-page-sized pieces (what a
  HiCache load moves).

The model's ``step_overhead_s`` (scheduler, sampling, graph launch) is not part of any of
these, so predictions are printed without it. An engine's kernels (FlashInfer, FA3, fused
MoE/GEMM) are at least as fast as PyTorch's, so a measured time above the prediction is
an upper bound for a real engine; one far below means the profile is too pessimistic.

Needs torch with CUDA and transformers (the device machines have both):

    PYTHONPATH=$PWD python bench/gpu_profile.py [--profile llama3-8b-h100]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.cost_model import CostModel  # noqa: E402
from simulator.profiles import get_profile  # noqa: E402

# Architecture of each profile's model (what profiles.py states in prose).
ARCH = {
    "llama3-8b-h100": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}


def cuda_ms(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of ``fn`` on the GPU, timed by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graphed(fn):
    """``fn`` captured once in a CUDA graph; returns the replay."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm up outside the graph (cuBLAS picks its kernels)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def prefill_rows(model, cm: CostModel, torch) -> list[tuple]:
    from transformers import DynamicCache

    rows = []
    vocab = model.config.vocab_size
    overhead = cm.profile.step_overhead_s * 1000
    with torch.inference_mode():
        for n, c in ((512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0), (1024, 7168), (2048, 14336)):
            new = torch.randint(0, vocab, (1, n), device="cuda")
            if c:
                cache = DynamicCache(config=model.config)
                model(torch.randint(0, vocab, (1, c), device="cuda"), past_key_values=cache,
                      use_cache=True, logits_to_keep=1)

                def step(new=new, cache=cache, n=n):
                    model(new, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    cache.crop(-n)  # drop the new tokens again (negative: works across versions)
            else:
                def step(new=new):
                    model(new, use_cache=False, logits_to_keep=1)
            ms = cuda_ms(step)
            pred = cm.prefill_time(n, c) * 1000 - overhead
            rows.append((f"prefill {n} new after {c} cached", ms, pred, n / ms * 1000))
            del new
            torch.cuda.empty_cache()
    return rows


def attention_rows(cfg, cm: CostModel, torch) -> list[tuple]:
    """The attention term of prefill alone: new tokens attending to a cached prefix and to
    each other (bottom-right causal, as an engine's extend kernel does), on PyTorch's flash
    kernel (FlashAttention-2 class) and on cuDNN's (Hopper-specific on an H100, the class of
    FA3, SGLang's default there). The model forward above cannot show it apart: with a
    cache, transformers hands SDPA an explicit mask, which rules out the flash kernel."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    d = cfg.hidden_size // heads
    p = cm.profile
    rows = []
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
        for n, c in ((8192, 0), (1024, 7168), (2048, 14336), (512, 15872)):
            bf = {"device": "cuda", "dtype": torch.bfloat16}
            q = torch.randn(1, heads, n, d, **bf)
            # Key/value heads repeated to the query heads: GQA support varies by kernel and
            # version, and prefill attention is bound by FLOPs, not by reading K and V.
            k = torch.randn(1, kv_heads, n + c, d, **bf).repeat_interleave(heads // kv_heads, dim=1)
            v = torch.randn_like(k)
            # With no cached prefix, bottom-right causal is plain causal, which every kernel
            # takes; with one, the bias object where the kernel takes it, else a dense mask.
            # Apart: the prefix with no mask plus the new tokens causal, two calls (what one
            # fused extend kernel does, less the merge of the two halves' outputs).
            bias = causal_lower_right(n, n + c)
            dense = torch.ones(n, n + c, dtype=torch.bool, device="cuda").tril(c)
            tries = ([("", dict(is_causal=True))] if c == 0 else
                     [("", dict(attn_mask=bias)), (" dense mask", dict(attn_mask=dense))])
            variants = [tries] + ([[(" apart", None)]] if c else [])
            halves = (k[:, :, :c].contiguous(), v[:, :, :c].contiguous(),
                      k[:, :, c:].contiguous(), v[:, :, c:].contiguous())
            for variant in variants:
                for how, kw in variant:
                    def attend(q=q, k=k, v=v, kw=kw, halves=halves):
                        with sdpa_kernel(backend):
                            for _ in range(layers):
                                if kw is None:
                                    F.scaled_dot_product_attention(q, halves[0], halves[1])
                                    F.scaled_dot_product_attention(q, halves[2], halves[3], is_causal=True)
                                else:
                                    F.scaled_dot_product_attention(q, k, v, **kw)
                    try:
                        ms = cuda_ms(attend)
                    except RuntimeError as exc:  # no kernel of this backend takes these inputs
                        print(f"{label}{how}, {n} new after {c} cached: {str(exc).splitlines()[0][:160]}",
                              flush=True)
                        continue
                    flops = 4.0 * p.n_layers * p.q_dim * (n * c + n * n / 2.0)
                    pred = flops / p.tp / p.eff_flops * 1000
                    rows.append((f"prefill attention only, {n} new after {c} cached ({label}{how})", ms, pred,
                                 flops / ms / 1e9))  # TFLOP/s
                    break
            del q, k, v, dense, halves
            torch.cuda.empty_cache()
    return rows


def decode_rows(cfg, cm: CostModel, torch) -> list[tuple]:
    """Weights pass and attention of one decode step, each in a CUDA graph."""
    import torch.nn.functional as F

    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    shapes = [(h, (heads + 2 * kv_heads) * d), (heads * d, h), (h, 2 * inter), (inter, h)]
    weights = [[torch.randn(i, o, **bf) * 0.01 for i, o in shapes] for _ in range(layers)]
    head = torch.randn(h, cfg.vocab_size, **bf) * 0.01
    weight_bytes = sum(w.numel() * 2 for ws in weights for w in ws) + head.numel() * 2
    rows = []
    p = cm.profile
    for b in (1, 16, 64, 256):
        xs = {i: torch.randn(b, i, **bf) for i, _ in shapes}
        xh = torch.randn(b, h, **bf)

        def matmuls(xs=xs, xh=xh):
            for ws in weights:
                for (i, _), w in zip(shapes, ws):
                    torch.matmul(xs[i], w)
            torch.matmul(xh, head)
        ms = cuda_ms(graphed(matmuls), warmup=3, iters=10)
        pred = max(p.weight_bytes_per_gpu / p.eff_hbm_bw, 2.0 * p.params * b / p.eff_flops) * 1000
        rows.append((f"decode weights pass, batch {b}", ms, pred,
                     weight_bytes / ms / 1e6))  # GB/s
    for b, ctx in ((16, 2000), (64, 2000), (256, 1000), (64, 8000)):
        q = torch.randn(b, heads, 1, d, **bf)
        k = torch.randn(b, kv_heads, ctx, d, **bf)
        v = torch.randn(b, kv_heads, ctx, d, **bf)

        def attend(q=q, k=k, v=v):
            for _ in range(layers):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ms = cuda_ms(graphed(attend), warmup=3, iters=10)
        kv_bytes = b * ctx * p.kv_bytes_per_token
        pred = kv_bytes / p.eff_hbm_bw * 1000
        rows.append((f"decode attention, batch {b} x {ctx} ctx", ms, pred, kv_bytes / ms / 1e6))
        del q, k, v
    return rows  # the weights go with this frame; main empties the cache


def copy_rows(cm: CostModel, torch) -> list[tuple]:
    p = cm.profile
    rows = []
    total = 2 << 30
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pred = total / p.host_bw * 1000
    ms = cuda_ms(lambda: dev.copy_(host, non_blocking=True), 1, 3)
    rows.append(("host->device, 2 GiB pinned, one copy", ms, pred, total / ms / 1e6))
    ms = cuda_ms(lambda: host.copy_(dev, non_blocking=True), 1, 3)
    rows.append(("device->host, 2 GiB pinned, one copy", ms, pred, total / ms / 1e6))
    page = 16 * p.kv_bytes_per_token // p.tp  # one 16-token page of every layer's K and V
    per_layer = page // cm.profile.n_layers
    for size, what in ((page, "page (16 tokens, all layers)"), (per_layer, "page-layer (16 tokens, one layer)")):
        count = min(total // size, 4096)
        hv, dv = host[: count * size].view(count, size), dev[: count * size].view(count, size)

        def pieces(hv=hv, dv=dv, count=count):
            for i in range(count):
                dv[i].copy_(hv[i], non_blocking=True)
        ms = cuda_ms(pieces, 1, 3)
        rows.append((f"host->device, {count} x {size // 1024} KiB {what}", ms,
                     count * size / p.host_bw * 1000, count * size / ms / 1e6))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="llama3-8b-h100", choices=sorted(ARCH))
    ap.add_argument("--skip", nargs="*", default=[], choices=["prefill", "attention", "decode", "copy"])
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    cm = CostModel(get_profile(args.profile))
    cfg = LlamaConfig(**ARCH[args.profile], max_position_embeddings=32768)
    rows: list[tuple] = []
    if "prefill" not in args.skip:
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
        params = sum(t.numel() for t in model.parameters())
        print(f"model: {args.profile} shape, {params / 1e9:.2f}e9 parameters, random bf16 weights, "
              f"attention {model.config._attn_implementation}", flush=True)
        rows += prefill_rows(model, cm, torch)
        del model
        torch.cuda.empty_cache()
    if "attention" not in args.skip:
        rows += attention_rows(cfg, cm, torch)
    if "decode" not in args.skip:
        rows += decode_rows(cfg, cm, torch)
        torch.cuda.empty_cache()
    if "copy" not in args.skip:
        rows += copy_rows(cm, torch)

    print(f"# GPU check of the cost model ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC})")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{platform.system()} {platform.release()}")
    print(f"command: PYTHONPATH=$PWD python {' '.join(sys.argv)}")
    print()
    print("| what | measured ms | model ms (no step overhead) | measured / model | throughput |")
    print("|---|---|---|---|---|")
    for name, ms, pred, rate in rows:
        unit = ("TFLOP/s" if "attention only" in name else "tok/s" if name.startswith("prefill")
                else "GB/s")
        print(f"| {name} | {ms:.2f} | {pred:.2f} | {ms / pred:.2f} | {rate:,.0f} {unit} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
