"""The peer figure for MLA prefill attention (../shared/docs/H200.md): torch's SDPA on its cuDNN backend with Kimi-K3's
MLA prefill shapes (one sequence, 96 heads, q/k 192, v 128, causal, bf16), timed with CUDA events in the same GPU call
as `batchgen bench kernels --kernels mla_prefill_attention`. FLOPs counted as batchgen counts them:
2 * H * (192 + 128) * T * (T + 1) / 2.  Usage: python torch_sdpa_mla.py [T ...]"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

H, DQK, DV = 96, 192, 128


def measure(t: int, reps: int = 20) -> None:
    g = torch.Generator(device="cuda").manual_seed(t)
    q = torch.randn(1, t, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(1, t, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    v = torch.randn(1, t, H, DV, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    times.sort()
    ms = times[len(times) // 2]
    flops = 2.0 * H * (DQK + DV) * t * (t + 1) / 2
    print(f"torch sdpa cudnn T={t}: {ms:.4f} ms, {flops / ms / 1e9:.1f} TFLOP/s (median of {reps})")


if __name__ == "__main__":
    for t in [int(a) for a in sys.argv[1:]] or [4096, 16384]:
        measure(t)
