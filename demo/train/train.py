"""Train the bundled demo model: a small qwen2moe, from scratch, on one GPU.

The demo needs a real Mixture-of-Experts model whose experts are worth
quantizing and healing, small enough to commit (Q8_0 GGUF <= 25 MB) and to run
on a laptop CPU, and shaped like the models people quantize: many routed
experts with several active per token, so that some experts see few
calibration tokens, plus a shared expert (as in Qwen1.5-MoE and Qwen3-Next).
Shape constraints come from the formats: every matrix row is a multiple of 256
weights (the 256-weight blocks of TQ2_0, the k-quants and the i-quants), so
the hidden size and the expert width are both 256; 32 routed experts with
top-4 routing then cost 6.3M weights per layer, and three layers, a shared
expert as wide as a routed one (as in Qwen3-Next and DeepSeek-V3) and a 6,144
token vocabulary fit the 25 MB budget at Q8_0. The embeddings stay untied:
llama.cpp's qwen2moe requires its own ``output.weight``.

Load balance is enforced per layer: transformers' auxiliary loss balances the
expert load summed over all layers, which can leave a single layer with nearly
idle experts (and an idle expert has no calibration tokens to heal from). Here
each layer gets its own Switch-style loss ``E * sum_e f_e * P_e`` and the mean
over layers is added with weight ``--balance-coef``.

The schedule is by wall-clock time (warmup, then cosine decay to 10% over
``--minutes``), so the run ends on time whatever the GPU's throughput.
Before training, each available experts kernel is timed for a few steps and
the fastest one that works is used.

Inputs: ``--data`` holds ``tokens.npz`` from ``encode.py``. Outputs in
``--out``: ``config.json``, ``model-0000N.safetensors`` (fp16 shards, each
under 15 MB) and ``train_log.json`` (tokens seen, losses, held-out
cross-entropy per stratum, time, per-layer expert load).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

SHARD_BYTES = 15_000_000


def demo_config(tiny: bool) -> Qwen2MoeConfig:
    """The demo model's architecture (``tiny``: a CPU-sized variant for testing the script)."""
    hidden = 64 if tiny else 256
    return Qwen2MoeConfig(
        vocab_size=6144,
        hidden_size=hidden,
        num_hidden_layers=2 if tiny else 3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        num_experts=8 if tiny else 32,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        use_sliding_window=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Mean over layers of the Switch load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the share of top-k slots given to expert e (no gradient),
    ``P_e`` the mean router probability of e; the loss is 1 at perfect
    balance and grows as the load concentrates.
    """
    losses = []
    for logits in router_logits:  # each (N, E)
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        n_expert = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (N, k)
        share = F.one_hot(chosen, n_expert).float().sum(dim=(0, 1)) / chosen.numel()  # (E,)
        losses.append(n_expert * torch.sum(share.detach() * probs.mean(dim=0)))
    return torch.stack(losses).mean()


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first ``warmup`` fraction of time, then cosine decay to 10% of peak."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def random_batch(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``seq + 1`` tokens at random offsets of the stream."""
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen, device=tokens.device)  # (B,)
    offsets = torch.arange(seq + 1, device=tokens.device)  # (T+1,)
    return tokens[starts[:, None] + offsets[None, :]].long()  # (B, T+1)


def heldout_batches(tokens: torch.Tensor, seq: int, n_seq: int, batch: int) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows of the held-out stream, grouped in batches."""
    n_seq = min(n_seq, (tokens.numel() - 1) // (seq + 1))
    windows = tokens[: n_seq * (seq + 1)].long().view(n_seq, seq + 1)  # (S, T+1)
    return [windows[i:i + batch] for i in range(0, n_seq, batch)]


def step_loss(model: Qwen2MoeForCausalLM, ids: torch.Tensor, balance_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy (float32) and the per-layer balance loss for one batch ``(B, T+1)``."""
    out = model(input_ids=ids[:, :-1], output_router_logits=True, use_cache=False)
    logits = out.logits  # (B, T, V)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    balance = per_layer_balance_loss(out.router_logits, model.config.num_experts_per_tok)
    return ce + balance_coef * balance, ce


@torch.no_grad()
def evaluate(model: Qwen2MoeForCausalLM, batches: list[torch.Tensor], amp: bool) -> tuple[float, list[list[float]]]:
    """Held-out mean cross-entropy per token and per-layer expert load (share of top-k slots per expert)."""
    model.eval()
    total, count = 0.0, 0
    loads: torch.Tensor | None = None
    for ids in batches:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=ids[:, :-1], output_router_logits=True, use_cache=False)
        logits = out.logits.float()  # (B, T, V)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
        count += ids[:, 1:].numel()
        chosen = torch.stack([torch.topk(r.float(), model.config.num_experts_per_tok, dim=-1).indices
                              for r in out.router_logits])  # (L, N, k)
        counts = F.one_hot(chosen, model.config.num_experts).sum(dim=(1, 2)).double()  # (L, E)
        loads = counts if loads is None else loads + counts
    model.train()
    shares = loads / loads.sum(dim=1, keepdim=True)  # (L, E)
    return total / count, shares.tolist()


def save_shards(model: Qwen2MoeForCausalLM, out: Path) -> list[str]:
    """fp16 safetensors shards, each under SHARD_BYTES, filled greedily in state-dict order."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to(torch.float16).cpu().contiguous()
        nbytes = t.numel() * 2
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names = []
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}.safetensors"
        save_file(shard, str(out / name))
        names.append(name)
    return names


@dataclass
class RunResult:
    """What one training run produced."""

    model: Qwen2MoeForCausalLM
    steps: int
    tokens_seen: int
    train_loss: float
    seconds: float
    curve: list[tuple[int, float, float]]


def train(model: Qwen2MoeForCausalLM, tokens: torch.Tensor, args: argparse.Namespace, seconds: float,
          max_steps: int | None) -> RunResult:
    """Train for ``seconds`` of wall time (or ``max_steps``), with the time-based schedule.

    With ``seconds=inf`` (kernel timing, smoke run) the schedule stays at its
    start, learning rate 0: those runs exercise every code path, not learning.
    """
    device = tokens.device
    amp = device.type == "cuda"
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=amp)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    steps, recent, curve = 0, [], []
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds or (max_steps is not None and steps >= max_steps):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(elapsed / seconds, args.lr, args.warmup)
        ids = random_batch(tokens, args.batch, args.seq, gen)  # (B, T+1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss, ce = step_loss(model, ids, args.balance_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        if steps % args.log_every == 0:
            ce_value = ce.item()
            recent.append(ce_value)
            curve.append((steps, round(time.perf_counter() - start, 1), round(ce_value, 4)))
            print(f"step {steps} t={curve[-1][1]}s lr={opt.param_groups[0]['lr']:.2e} ce={ce_value:.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    tail = recent[-10:] or [ce.item()]
    return RunResult(model, steps, steps * args.batch * args.seq, float(np.mean(tail)),
                     time.perf_counter() - start, curve)


def experts_kernels(device: torch.device) -> list[str]:
    """Experts implementations worth trying on this device, fastest candidates first."""
    return ["grouped_mm", "batched_mm", "eager"] if device.type == "cuda" else ["eager"]


def pick_experts_kernel(tokens: torch.Tensor, args: argparse.Namespace) -> str:
    """Time a few training steps with each experts kernel; return the fastest that runs."""
    best, best_time = "eager", math.inf
    for kernel in experts_kernels(tokens.device):
        torch.manual_seed(args.seed)
        model = build_model(args, kernel, tokens.device)
        try:
            train(model, tokens, args, seconds=math.inf, max_steps=2)
            if tokens.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train(model, tokens, args, seconds=math.inf, max_steps=args.probe_steps)
            took = time.perf_counter() - t0
        except Exception as err:  # an unavailable kernel is expected on some builds: skip it
            print(f"experts kernel {kernel}: failed ({type(err).__name__}: {str(err)[:200]})", flush=True)
            continue
        print(f"experts kernel {kernel}: {took / args.probe_steps * 1000:.1f} ms/step", flush=True)
        if took < best_time:
            best, best_time = kernel, took
    return best


def build_model(args: argparse.Namespace, kernel: str, device: torch.device) -> Qwen2MoeForCausalLM:
    """A freshly initialized demo model on ``device`` using the given experts kernel."""
    config = demo_config(args.tiny)
    config._experts_implementation = kernel
    return Qwen2MoeForCausalLM(config).to(device)


def main() -> None:
    """Load tokens, pick the experts kernel, optionally smoke-test, train, evaluate, save."""
    wall0 = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=6.5)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--smoke-steps", type=int, default=0, help="first run this many steps end to end, then the real run")
    parser.add_argument("--probe-steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=float, default=0.03)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--balance-coef", type=float, default=0.02)
    parser.add_argument("--heldout-seqs", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model, for testing this script")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    data = np.load(args.data / "tokens.npz")
    tokens = torch.from_numpy(data["train"].astype(np.int32)).to(device)  # (N,)
    # The same number of held-out windows from every stratum: the overall held-out loss and the
    # expert load weigh the strata equally, and each stratum's loss is reported on its own.
    strata = sorted(k.removeprefix("heldout_") for k in data.files if k.startswith("heldout_"))
    stratum_batches = {s: heldout_batches(torch.from_numpy(data[f"heldout_{s}"].astype(np.int32)).to(device),
                                          args.seq, args.heldout_seqs // len(strata), max(1, args.batch // 2))
                       for s in strata}
    eval_batches = [b for s in strata for b in stratum_batches[s]]
    heldout_tokens = int(data["heldout"].size)
    print(f"device={device} train_tokens={tokens.numel()} heldout_tokens={heldout_tokens}", flush=True)

    kernel = pick_experts_kernel(tokens, args)
    print(f"using experts kernel {kernel}", flush=True)
    if args.smoke_steps:
        torch.manual_seed(args.seed)
        smoke = train(build_model(args, kernel, device), tokens, args, seconds=math.inf, max_steps=args.smoke_steps)
        smoke_loss, _ = evaluate(smoke.model, eval_batches[:1], device.type == "cuda")
        smoke_dir = args.out / "smoke"
        smoke_dir.mkdir(parents=True, exist_ok=True)
        save_shards(smoke.model, smoke_dir)
        for f in smoke_dir.iterdir():
            f.unlink()
        smoke_dir.rmdir()
        print(f"smoke ok: {smoke.steps} steps, train ce {smoke.train_loss:.3f}, held-out ce {smoke_loss:.3f}", flush=True)

    torch.manual_seed(args.seed)
    model = build_model(args, kernel, device)
    n_params = sum(p.numel() for p in model.parameters())
    result = train(model, tokens, args, seconds=args.minutes * 60.0, max_steps=args.max_steps)
    heldout_loss, load = evaluate(model, eval_batches, device.type == "cuda")
    stratum_loss = {s: evaluate(model, batches, device.type == "cuda")[0] for s, batches in stratum_batches.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(args.out)
    shards = save_shards(model, args.out)
    log = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "experts_kernel": kernel,
        "parameters": n_params,
        "steps": result.steps,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_seen": result.tokens_seen,
        "train_tokens_available": int(tokens.numel()),
        "train_loss": result.train_loss,
        "heldout_loss": heldout_loss,
        "heldout_tokens_scored": sum(b[:, 1:].numel() for b in eval_batches),
        "heldout_loss_by_stratum": stratum_loss,
        "heldout_tokens_by_stratum": {s: sum(b[:, 1:].numel() for b in batches)
                                      for s, batches in stratum_batches.items()},
        "train_seconds": round(result.seconds, 1),
        "wall_seconds": round(time.perf_counter() - wall0, 1),
        "expert_load": load,
        "expert_load_min": [min(layer) for layer in load],
        "expert_load_max": [max(layer) for layer in load],
        "curve": result.curve,
        "args": {k: str(v) for k, v in vars(args).items()},
        "shards": shards,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: log[k] for k in ("steps", "tokens_seen", "train_loss", "heldout_loss", "heldout_loss_by_stratum",
                                          "train_seconds", "expert_load_min", "expert_load_max")}), flush=True)


if __name__ == "__main__":
    main()
