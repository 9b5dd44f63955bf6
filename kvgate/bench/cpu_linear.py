"""CPU GEMM micro-benchmark: PyTorch's default `F.linear` (MKL) against the oneDNN-packed `PackedLinear` on
W-CPU's model (SmolLM2-135M) projections, float32, interleaved and reported as the median of N calls.

    python -m kvgate.bench.cpu_linear [--rows 1,32,256] [--repeats 50] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

# out_features, in_features of SmolLM2-135M's fused projections and its (tied) lm_head
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}


@dataclass(slots=True)
class Result:
    layer: str
    rows: int
    blas_ms: float
    onednn_ms: float
    speedup: float
    max_abs_diff: float


def medians_ms(fns, repeats: int) -> list[float]:
    """Each function's median time, calls interleaved so drift on a shared machine hits all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,256", help="comma-separated batch rows")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from kvgate.bench.report import cpu_model
    from kvgate.kernels.cpu_linear import PackedLinear

    print(f"# {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, float32")
    print(f"{'layer':14} {'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'speedup':>8} {'maxdiff':>8}")
    results = []
    for layer, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features)
            packed = PackedLinear(weight, None, rows_hint=rows)
            blas_ms, onednn_ms = medians_ms([lambda: F.linear(x, weight), lambda: packed(x)], args.repeats)
            r = Result(layer, rows, blas_ms, onednn_ms, blas_ms / onednn_ms,
                       (packed(x) - F.linear(x, weight)).abs().max().item())
            results.append(r)
            print(f"{layer:14} {rows:5d} {blas_ms:12.3f} {onednn_ms:10.3f} {r.speedup:8.2f} {r.max_abs_diff:8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
