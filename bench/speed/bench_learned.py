"""One layer's learned-rounding unit against its GPTQ unit, timed in the same run.

    python bench/speed/bench_learned.py                        # CPU: the demo's layer, 32 experts 256 x 256, top-4
    python bench/speed/bench_learned.py --gpu --shape 30b      # CUDA JAX: a Qwen3-30B-A3B layer, 128 experts,
                                                               # d = 2048, f = 768, top-8

The layer is synthetic at the real shape: heavy-tailed expert weights, MoE
inputs from correlated random directions, a random top-k routing with softmax
weights, and the reference routed output yr computed from the float weights.
The GPTQ unit is what `round = "gptq"` runs for a layer
(`quantize.layer_importance`: the per-expert statistics and damped Hessians,
then `kernels.quantize_experts` for gate, up and down); the learned unit is
that plus `kernels.learned.learn_layer` with the pipeline's settings
(`learned_steps` default, `quantize.LEARNED_*`), on the calibration rows less
the held-out 1/8. Times (wall seconds, or CPU seconds with --cpu-time) exclude compilation (each is run once before), best
of ``--repeats``; the printed ratio is learned unit / GPTQ unit. Also printed:
the held-out relative error of the layer's output at GPTQ's bytes and at the
learned ones (in-sample selection: the held-out rows pick the step), and whether
every run of the learned unit wrote the same bytes (a device that sums in no
fixed order would not). With --heal-path, the learning is also timed as the heal's
quantize unit calls it (`quantize.learn_layer_rounding`), to tell a cost of that path from the device's.
The rows reach the unit as host copies in ordinary memory, as a dump's read hands them to the heal;
`--device-backed-rows` hands it the arrays `np.asarray` makes of the device's instead (what this bench
did before: on a GPU the runtime may back them with pinned memory, whose transfers are faster), so one
pair of runs says what the rows' memory costs the unit.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.device_trace import traced  # noqa: E402
from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.commands.init import UNSEEN_TOKENS  # noqa: E402  (the heal's unit measures it)
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402

library_gemms()  # the products as every moeheal command runs them: cuBLAS, not autotuned Triton GEMMs

# what `quantize.token_set` asks of the source GGUF for a layer without a shared expert: nothing else
SOURCE_WITHOUT_SHARED_EXPERT = SimpleNamespace(arch=SimpleNamespace(has_shared_expert=False))


def print_nothing(_: str) -> None:
    """The unit's log line, not wanted between the table's rows."""


SHAPES = {"small": (4, 256, 256, 2), "demo": (32, 256, 256, 4), "30b": (128, 2048, 768, 8)}  # experts, d, f, k


def synthetic_layer(n_expert: int, d: int, f: int, k: int, tokens: int, seed: int = 0, copied: bool = True):
    """Float experts gate/up (E, f, d), down (E, d, f) on the device; inputs (T, d), routing (T, k) x2 and
    the reference routed output yr (T, d) on the host. Drawn on the device (a 30B layer is 604M weights).
    `copied`: the host rows are copies in ordinary memory, as a dump's read gives them; else the arrays
    `np.asarray` makes of the device's, whose memory the runtime owns (on a GPU perhaps pinned, which
    makes a transfer back to the device faster than a heal's ever is)."""
    import jax
    import jax.numpy as jnp

    from moeheal.pipeline.model.layers import moe_forward

    keys = jax.random.split(jax.random.key(seed), 6)
    gate = 0.02 * jax.random.t(keys[0], 4.0, (n_expert, f, d), jnp.float32)
    up = 0.02 * jax.random.t(keys[1], 4.0, (n_expert, f, d), jnp.float32)
    down = 0.02 * jax.random.t(keys[2], 4.0, (n_expert, d, f), jnp.float32)
    mix = jax.random.normal(keys[3], (d, d), jnp.float32) / np.sqrt(d)
    x = 4.0 * jax.random.normal(keys[4], (tokens, d), jnp.float32) @ mix  # (T, d), correlated directions
    logits = 2.0 * jax.random.normal(keys[5], (tokens, n_expert), jnp.float32)  # (T, E)
    top, experts = jax.lax.top_k(logits, k)  # (T, k) x2
    weights = jax.nn.softmax(top, axis=-1)  # (T, k)
    w = {"ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down}
    yr = jax.jit(moe_forward)({"gate_exps": gate, "up_exps": up, "down_exps": down}, x, experts, weights)
    host = (np.asarray(x), np.asarray(experts, np.int32), np.asarray(weights), np.asarray(yr))
    return w, *(np.array(a, copy=True) if copied else a for a in host)


def step_programs(fmt: str, w: dict, raw: dict, train, batch: int, hlo: Path) -> None:
    """One learned step's programs at this layer, each timed alone (median of 10 calls after a compiling
    one, the device's work waited for): per tensor its decoding and its update, and the layer's loss and
    gradient; each program's optimised HLO written to `hlo` (its fusions name the trace's kernels)."""
    import statistics

    import jax
    import jax.numpy as jnp

    from moeheal.kernels import learned as L
    from moeheal.kernels.decode import format_of

    hlo.mkdir(parents=True, exist_ok=True)

    def median_ms(fn, *a) -> float:
        jax.block_until_ready(fn(*a))
        times = []
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    def dump(name: str, fn, *a) -> None:
        (hlo / f"{name}.txt").write_text(fn.lower(*a).compile().as_text())

    relax = L.relaxation(fmt)
    n_expert = w["ffn_gate_exps"].shape[0]
    order = L.batch_order(len(train), 1, batch, 0)
    capacity = L.expert_capacity(train.experts, n_expert, order)
    rows = L._device_rows(train)
    layouts = jax.tree.map(jnp.asarray, L._layouts(train, order, n_expert, capacity, batch))
    weights, chosen, parts = {}, {}, []
    for name in w:
        shape = tuple(w[name].shape)
        const = relax.const(jnp.asarray(raw[name]).reshape(-1, format_of(fmt).type_size))
        theta = relax.init(const)
        decode = L._decoder(fmt, shape)
        weights[name], chosen[name] = decode(theta, const)
        parts.append((name, shape, const, theta))
        parts[-1] += (median_ms(decode, theta, const),)
        dump(f"decode_{name}", decode, theta, const)
    index = jnp.int32(0)
    t_loss = median_ms(L._loss_and_grad, weights, {}, rows, layouts, index)
    dump("loss_and_grad", L._loss_and_grad, weights, {}, rows, layouts, index)
    _, grad_w, _ = L._loss_and_grad(weights, {}, rows, layouts, index)
    decays = jnp.ones((1,), jnp.float32)
    line = [f"loss and gradient {t_loss:.2f} ms"]
    for name, shape, const, theta, t_decode in parts:
        update = L._updater(fmt, shape, "adam")
        moments = (jax.tree.map(jnp.zeros_like, theta),) * 2
        bounds, rates = jax.tree.map(jnp.float32, (relax.bounds(), dict.fromkeys(relax.groups(), 1e-3)))
        call = (theta, moments, const, chosen[name], grad_w[name], index, decays, bounds, rates)
        line.append(f"{name}: decode {t_decode:.2f} ms, update {median_ms(update, *call):.2f} ms")
        dump(f"update_{name}", update, *call)
    print(f"{fmt}: one step's programs alone: " + "; ".join(line), flush=True)
    if isinstance(relax, L.CodebookRelaxation):  # the decoding with the choice as it was, in the same run
        with reduced_choice(L.CodebookRelaxation):
            before = {name: median_ms(L._decoder(fmt, shape), theta, const) for name, shape, const, theta, _ in parts}
            for name, shape, const, theta, _ in parts:
                dump(f"decode_before_{name}", L._decoder(fmt, shape), theta, const)
        print(f"{fmt}: decode with the choice reduced over (neighbours, group weights), as before: "
              + "; ".join(f"{name} {ms:.2f} ms" for name, ms in before.items()), flush=True)


@contextmanager
def reduced_choice(cls):
    """The codebook choice as it was before it was written out elementwise (a reduction over the group's
    weights, then an argmin over the neighbours), for this bench's baseline; the decoders compiled under
    it are dropped on leaving."""
    import jax.numpy as jnp

    from moeheal.kernels import learned as L

    def choice(self, theta, const):
        target = self._target(theta, const)  # (n, G, g)
        nbrs = jnp.asarray(L.format_neighbours(self.cls))  # (K, N)
        cand = jnp.asarray(L.format_neighbour_values(self.cls))[const["idx"]]  # (n, G, N, g)
        dist = jnp.sum((cand - target[:, :, None, :]) ** 2, axis=-1)  # (n, G, N)
        return {"idx": nbrs[const["idx"], jnp.argmin(dist, axis=-1)]}  # (n, G)

    now = cls.choice
    cls.choice = choice
    L._decoder.cache_clear()
    try:
        yield
    finally:
        cls.choice = now
        L._decoder.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="time on a CUDA JAX device")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--tokens", type=int, default=8192, help="calibration rows of the layer")
    parser.add_argument("--formats", nargs="*", default=["q2_k", "iq2_xxs", "tq2_0"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None,
                        help="learned_steps (default: the config's, one pass over the training rows)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="also run each learned unit once under jax.profiler into this folder and print the "
                             "trace's summary (bench/tools/device_trace.py); with --heal-path, the heal's call too")
    parser.add_argument("--device-backed-rows", action="store_true",
                        help="hand the unit the host arrays np.asarray makes of the device's rows (as this bench did "
                             "until the rows were copied: on a GPU their memory may be the runtime's pinned buffers)")
    parser.add_argument("--heal-path", action="store_true",
                        help="also time the learning as the heal's quantize unit calls it "
                             "(`quantize.learn_layer_rounding`: the rows as the dump gives them, init's 8,192-row "
                             "unseen set read and measured) beside this bench's direct `learn_layer` call")
    parser.add_argument("--programs", type=Path, default=None,
                        help="also time one step's programs alone (each tensor's decoding and update, the layer's "
                             "loss and gradient; median of 10 calls) and write each one's optimised HLO to this folder")
    parser.add_argument("--reduced-choice", action="store_true",
                        help="run the codebook formats' choice as it was (`reduced_choice`): the baseline of the "
                             "choice written out elementwise, run beside it as a second command")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time CPU seconds of every thread (time.process_time): on a shared machine the wall "
                             "clock counts other people's work too")
    args = parser.parse_args()

    import jax

    from moeheal.kernels import encode
    from moeheal.kernels import learned
    from moeheal.pipeline.stages import quantize as Q

    device = jax.devices("gpu")[0] if args.gpu else jax.devices("cpu")[0]
    n_expert, d, f, k = SHAPES[args.shape]
    steps, batch = Q.learned_schedule(args.tokens - args.tokens // Q.LEARNED_HOLDOUT, args.steps or 0)
    print(f"device: {device.device_kind}; layer: {n_expert} experts, d = {d}, f = {f}, top-{k}, {args.tokens} "
          f"calibration rows; learned: {steps} steps of {batch} tokens; best of {args.repeats} "
          f"after a compiling call; {'CPU seconds of every thread' if args.cpu_time else 'wall seconds'}\n")
    print("| format | GPTQ unit s | learned unit s | learned / GPTQ | learning alone s | ms per step "
          "| held-out rel. error GPTQ | held-out rel. error learned |")
    print("|---|---|---|---|---|---|---|---|")
    traces: list[str] = []
    with jax.default_device(device), reduced_choice(learned.CodebookRelaxation) if args.reduced_choice else nullcontext():
        w, x, experts, weights, yr = synthetic_layer(n_expert, d, f, k, args.tokens, copied=not args.device_backed_rows)
        cut = args.tokens - args.tokens // Q.LEARNED_HOLDOUT
        cal = learned.TokenSet(x, experts, weights, yr, yr)
        train, held = cal.take(np.arange(cut)), cal.take(np.arange(cut, args.tokens))
        rows = {"mixed": x, "experts": experts, "weights": weights, "yr": yr}  # as `quantize.calibration_rows`
        last = slice(max(0, args.tokens - UNSEEN_TOKENS), None)  # the unseen set: only measured, so any rows do
        unseen = {"0": {**{key: value[last] for key, value in rows.items()}, "hh": np.zeros((len(x[last]), 1))}}
        for fmt in args.formats:
            params = Q.QuantizeParams(quant=dict.fromkeys(Q.EXPERT_TENSORS, fmt), round="gptq", importance=True,
                                      beta_gate_up=0.5, beta_down=0.5, down_blend_tokens=16.0, cal_tokens=0,
                                      gptq_damp=1.0, gptq_shrink=64.0, gptq_router_weighted=False)
            out: dict = {}
            digests: set[str] = set()  # the learned bytes of every run: one digest if the device repeats itself

            def gptq() -> None:
                plan = Q.layer_importance(w, x, experts, weights, params)
                out["raw"] = {name: encode.quantize_experts(w[name], fmt, *plan[name]) for name in w}

            def learn() -> None:
                tensors = {name: learned.LearnedTensor(fmt, tuple(w[name].shape), out["raw"][name]) for name in w}
                settings = learned.Settings(steps=steps, batch_tokens=batch, lr=Q.LEARNED_LR,
                                            eval_every=max(1, steps // Q.LEARNED_EVALS), sub_lr=Q.LEARNED_SUB_LR,
                                            scale_lr=Q.LEARNED_SCALE_LR, optimizer=Q.LEARNED_OPTIMIZER)
                out["learned"], out["curve"] = learned.learn_layer(tensors, {}, train, held, settings)
                digests.add(hashlib.sha256(b"".join(out["learned"][n].tobytes() for n in sorted(w))).hexdigest())

            def heal_path() -> None:
                arrays = {key: value for name in w for key, value in ((name, out["raw"][name]), (
                    f"{name}.shape", np.asarray(w[name].shape)), (f"{name}.format", np.asarray(fmt)))}
                Q.learn_layer_rounding(arrays, SOURCE_WITHOUT_SHARED_EXPERT, rows, unseen,
                                       replace(params, round=Q.LEARNED, learned_steps=args.steps or 0), 0, print_nothing)

            gptq(), learn()  # compile
            clock = time.process_time if args.cpu_time else time.perf_counter
            t_gptq, t_learn = best_of(gptq, args.repeats, clock), best_of(learn, args.repeats, clock)
            if args.heal_path:
                heal_path()  # compile the unseen set's measurement
                t_heal = best_of(heal_path, args.repeats, clock)
                print(f"{fmt}: learning as the heal calls it {t_heal:.2f} s, as this bench calls it {t_learn:.2f} s "
                      f"({t_heal / t_learn:.2f}x)", flush=True)
            held_rows = [r["loss"] for r in out["curve"] if r["split"] == "heldout"]
            chosen = next(r["loss"] for r in out["curve"] if r["split"] == "chosen")
            print(f"| {fmt} | {t_gptq:.2f} | {t_gptq + t_learn:.2f} | {(t_gptq + t_learn) / t_gptq:.2f}x "
                  f"| {t_learn:.2f} | {1e3 * t_learn / steps:.1f} | {held_rows[0]:.5f} | {chosen:.5f} |", flush=True)
            if args.trace is not None:
                with traced(args.trace / fmt, f"learned unit, {fmt}, {steps} steps") as summary:
                    learn()
                traces.append(summary.text)
                if args.heal_path:
                    with traced(args.trace / f"{fmt}-heal", f"learning as the heal calls it, {fmt}") as summary:
                        heal_path()
                    traces.append(summary.text)
            if args.programs is not None:
                step_programs(fmt, w, out["raw"], train, batch, args.programs / fmt)
            runs = 1 + args.repeats + (args.trace is not None)
            kept = next(r["step"] for r in out["curve"] if r["split"] == "chosen")
            print(f"{fmt}: learned bytes of {runs} runs {'identical' if len(digests) == 1 else 'DIFFER'} "
                  f"({len(digests)} distinct; kept step {kept}"
                  f"{': the start, so this says nothing of the steps' if kept == 0 else ''})", flush=True)
        for text in traces:
            print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
