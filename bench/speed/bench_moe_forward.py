"""The routed experts' forward, and its gradient, at a real layer's shapes: the scan over expert blocks
(`pipeline.model.layers._moe_scan`, what the CPU and large loads run) against one batched product over all
blocks, each block's expert matrices picked by a one-hot product (`_moe_batched`, what an accelerator runs
at small loads), at several block sizes.

    python bench/speed/bench_moe_forward.py                          # a small shape, CPU: minutes
    python bench/speed/bench_moe_forward.py --experts 128 --d 2048 --f 768 --tokens 512 4096   # Qwen3-30B-A3B's layer (a GPU)

Why: e2e's step runs every layer forward, then forward again inside its backward, at 512 tokens a
sequence. With 128 experts and 8 choices a token, the scan runs about 384 blocks of 16 rows, one small
program after another, each waiting for the last: the device is busy but does little. The batched form
runs the same products as three large batched matmuls (block = rows per block, so the padding stays
below E x block rows); the one-hot product copies each block's expert matrices exactly (1 x w + 0 x
the others, float32 at full precision) and keeps the backward a matmul, where a gather's backward would
be a scatter-add over repeated experts (atomics on a GPU: bits that change from run to run).

`--groups G [G ...]` adds the forward-only grouped form (`_moe_grouped`: G expert blocks per batched
product, what an accelerator runs for calibrate's and the sensitivity measure's outputs), `--no-batched`
leaves the batched form out and `--forward-only` every gradient (at a real layer's 65,536 rows the
scan's needs 53 GB):

    python bench/speed/bench_moe_forward.py --experts 128 --d 2048 --f 768 --tokens 65536 8192 --groups 16 64 --no-batched --forward-only

Printed per (tokens, implementation): the median time of the forward and of forward + gradient (all
weights and the input), the ratio to the scan's in the same run, and the largest difference from the
scan's output relative to its largest value.

    python bench/speed/bench_moe_forward.py --packed q2_k [--experts 128 --d 2048 --f 768 --tokens 512 4096]

With `--packed FORMAT`, what e2e's tuner runs instead: the experts quantized to FORMAT, and the
gradient taken in the fp16 scales' relative changes (the tuner's theta), not in the weights. Three forms
in the same run: every expert decoded then the batched product with its one-hot copy of each block's
matrices (the tuner before `PackedExperts`, the baseline of the ratios), the same decoded experts in the
scan, and `PackedExperts` (only the picked experts' blocks decoded). Their outputs must agree bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after site-packages: DESIGN.md, Imports

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.compile_cache import library_gemms

library_gemms()  # the products as every moeheal command runs them: cuBLAS, not autotuned Triton GEMMs


def timed(fn, *args, repeat: int = 5) -> float:
    """Median seconds of `fn(*args)` after one warm-up call (its compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def routed_batch(rng: np.random.Generator, n: int, args: argparse.Namespace) -> tuple[jax.Array, ...]:
    """n tokens' MoE inputs x (N, d), their routing (N, k) x2 over experts of uneven load, and an output
    cotangent g (N, d) for the gradients."""
    x = jnp.asarray(rng.standard_normal((n, args.d), np.float32))
    logits = rng.standard_normal((n, args.experts)) + np.linspace(0, 2, args.experts)  # uneven loads
    experts = jnp.asarray(np.argsort(-logits, axis=1)[:, :args.k].astype(np.int32))  # (N, k)
    weights = jnp.asarray(rng.dirichlet(np.ones(args.k), n).astype(np.float32))  # (N, k)
    return x, experts, weights, jnp.asarray(rng.standard_normal((n, args.d), np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--f", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128], help="rows per block, batched form")
    parser.add_argument("--groups", type=int, nargs="*", default=[],
                        help="expert blocks per product, grouped form (forward-only passes: no gradient timed)")
    parser.add_argument("--no-batched", action="store_true", help="leave the batched form out (large loads)")
    parser.add_argument("--forward-only", action="store_true",
                        help="time no gradient (the scan's at 65,536 rows needs 53 GB on the device)")
    parser.add_argument("--packed", metavar="FORMAT", help="time the tuner's quantized forms instead (below)")
    args = parser.parse_args()
    if args.packed:
        return bench_packed(args)
    rng = np.random.default_rng(0)
    w = {"ffn_gate_exps.weight": rng.standard_normal((args.experts, args.f, args.d), np.float32) * 0.02,
         "ffn_up_exps.weight": rng.standard_normal((args.experts, args.f, args.d), np.float32) * 0.02,
         "ffn_down_exps.weight": rng.standard_normal((args.experts, args.d, args.f), np.float32) * 0.02}
    w = jax.tree.map(jnp.asarray, w)
    print(f"device {jax.devices()[0].device_kind}; E={args.experts} k={args.k} d={args.d} f={args.f}")
    for n in args.tokens:
        x, experts, weights, g = routed_batch(rng, n, args)
        # the routing is an argument of every program, not a constant of it: XLA would fold the sort of a
        # real layer's 524,288 (token, expert) pairs into the program, for minutes
        impls = {"scan": lambda w_, x_, e_, r_: M._moe_scan(w_, x_, e_, r_)}
        for b in [] if args.no_batched else args.blocks:
            impls[f"batched b={b}"] = (lambda b_: lambda w_, x_, e_, r_: M._moe_batched(w_, x_, e_, r_, b_))(b)
        for g_ in args.groups:
            impls[f"grouped G={g_}"] = (lambda g2: lambda w_, x_, e_, r_: M._moe_grouped(w_, x_, e_, r_, g2))(g_)
        ref = np.asarray(jax.jit(impls["scan"])(w, x, experts, weights))
        base = None
        for name, fn in impls.items():
            fwd = jax.jit(fn)
            t_fwd = timed(fwd, w, x, experts, weights)
            t_grad = None
            if not (name.startswith("grouped") or args.forward_only):
                grad = jax.jit(jax.grad(lambda w_, x_, e_, r_: jnp.sum(fn(w_, x_, e_, r_) * g), argnums=(0, 1)))
                t_grad = timed(grad, w, x, experts, weights)
            base = base or (t_fwd, t_grad)
            diff = float(np.max(np.abs(np.asarray(fwd(w, x, experts, weights)) - ref)) / np.max(np.abs(ref)))
            backward = (f"forward+grad {1e3 * t_grad:8.2f} ms ({base[1] / t_grad:5.2f}x)" if t_grad
                        else "forward+grad      -- (forward only)")
            print(f"N={n:6d} {name:14s} forward {1e3 * t_fwd:8.2f} ms ({base[0] / t_fwd:5.2f}x)  "
                  f"{backward}  max rel diff {diff:.1e}", flush=True)
    return 0


def bench_packed(args: argparse.Namespace) -> int:
    """The tuner's MoE product on FORMAT-quantized experts: decoded whole (one-hot copies; the scan) against
    `PackedExperts`, forward and the gradient in the scales' relative changes."""
    from moeheal.kernels import encode
    from moeheal.kernels.decode import format_of
    from moeheal.pipeline.model.tuner import BlockDecoder

    rng = np.random.default_rng(0)
    fmt = format_of(args.packed)
    shapes = {"ffn_gate_exps.weight": (args.f, args.d), "ffn_up_exps.weight": (args.f, args.d),
              "ffn_down_exps.weight": (args.d, args.f)}
    blocks = {name: jnp.asarray(encode.quantize_experts(jnp.asarray(
        rng.standard_normal((args.experts, *shape), np.float32) * 0.02), args.packed).reshape(args.experts, -1, fmt.type_size))
        for name, shape in shapes.items()}  # (E, n, type_size) each
    theta = {name: [jnp.zeros((args.experts, b.shape[1], 1), jnp.float32) for _ in fmt.fp16_parts]
             for name, b in blocks.items()}
    decoder = BlockDecoder(fmt)

    def packed(th):
        return {name: M.PackedExperts(blocks[name], tuple(th[name]), (), decoder, (args.experts, *shapes[name]))
                for name in blocks}

    def decoded(th):
        return {name: p.decoded() for name, p in packed(th).items()}

    print(f"device {jax.devices()[0].device_kind}; {args.packed}; E={args.experts} k={args.k} d={args.d} f={args.f}")
    for n in args.tokens:
        x, experts, weights, g = routed_batch(rng, n, args)
        forms = {"decoded, batched (before)": lambda th: M._moe_batched(decoded(th), x, experts, weights),
                 "decoded, scan": lambda th: M._moe_scan(decoded(th), x, experts, weights),
                 "packed, batched (now)": lambda th: M._moe_batched(packed(th), x, experts, weights)}
        base, ref = None, None
        for name, fn in forms.items():
            fwd = jax.jit(fn)
            grad = jax.jit(jax.grad(lambda th: jnp.sum(fn(th) * g)))
            t_fwd, t_grad = timed(fwd, theta), timed(grad, theta)
            out = np.asarray(fwd(theta))
            base, ref = base or (t_fwd, t_grad), out if ref is None else ref
            same = "identical" if np.array_equal(out, ref) else f"max rel diff {np.abs(out - ref).max() / np.abs(ref).max():.1e}"
            print(f"N={n:6d} {name:26s} forward {1e3 * t_fwd:8.2f} ms ({base[0] / t_fwd:5.2f}x)  "
                  f"forward+grad {1e3 * t_grad:8.2f} ms ({base[1] / t_grad:5.2f}x)  output {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
