"""Make `demo/peers/q2_k_autoround.gguf`: Intel AutoRound's Q2_K routed experts in llama.cpp's Q2_K peer.

AutoRound (sign-gradient descent on each weight's rounding offset and on the scales, 200 steps per
transformer block, minimising the block's output error on calibration inputs) is a strong public
2-bit quantizer that does more than round each weight alone. This script runs it on the demo's reference model with the demo's own
calibration documents and puts its routed-expert tensors, byte for byte as AutoRound packs them, into
a copy of `q2_k_imatrix.gguf` (llama.cpp's Q2_K peer). Everything else in the file stays identical, so
the peer differs from llama.cpp's only in how the routed experts were rounded: the comparison is of
the rounding, in the same format, at the same size.

It runs in its own virtual environment (requirements.txt beside it: torch, transformers,
auto-round; gguf-py from a llama.cpp checkout, below); moeheal never imports it. Steps:

1. transformers loads the Q8_0 reference GGUF (its loader leaves out the expert widths, passed here
   from the GGUF's keys) and the weights are re-saved as a float32 checkpoint: AutoRound takes a
   model directory (with a bare model object its GGUF defaults look for a hub name).
2. The calibration set. With `--trace` (the default peer): the very sequences our calibration dump
   and llama.cpp's importance matrix are made from, read from the lake's published `cal_trace`
   table (trace "calibration": 16 sequences of 512 tokens in the demo), so every quantizer in the
   comparison sees the same tokens. Without it: every `cal` document of `demo/split.csv` (text from
   `demo/docs.jsonl`, tokens from `demo/tokenizer.json`, no BOS, `<|endoftext|>` between documents)
   concatenated in doc-id order and cut into `seqlen`-token chunks, `nsamples` of them drawn with a
   seeded permutation (AutoRound's own default of 128 x 512 tokens makes `q2_k_autoround_65k`: eight
   times the calibration tokens the others get). No hub data.
3. AutoRound at `gguf:q2_k_s` with `enable_alg_ext`, attention, shared expert, router, lm_head and
   embeddings left alone (the peer keeps llama.cpp's tensors there anyway).
4. Each tuned expert linear layer is packed by AutoRound's own Q2_K packer (`ggml_quant`, what its
   GGUF export calls per tensor) from the scales and mins it tuned. Its whole-file GGUF export is
   not needed: only the routed-expert tensors go into the peer.
5. Checks that fail the script: AutoRound's log says it tuned every routed expert layer of every
   block and lowered each block's output loss; every expert layer carries the tuned Q2_K parameters;
   the packed bytes, decoded by gguf-py, equal AutoRound's own fake-quantized weights (to 1e-3 of the
   largest weight: the file stores d and dmin in fp16, AutoRound tunes them in fp32); their 2-bit
   codes differ from AutoRound's plain rounding (the same scheme, no tuning) in a sizeable share, so
   a silently skipped tuning fails.
6. The peer: the base file is copied and only `blk.*.ffn_{gate,up,down}_exps.weight` are overwritten
   in place (same names, type Q2_K, same byte sizes); the written file is read back and compared.

    LLAMA_CPP_ROOT=/path/to/llama.cpp venv/bin/python demo/peers/autoround/make_autoround_peer.py

LLAMA_CPP_ROOT is a llama.cpp source checkout (the build whose llama-quantize made the other peers):
AutoRound picks the per-layer GGUF defaults of a scheme through llama.cpp's conversion code, and the
copy it bundles names architectures that gguf-py 0.19.0 lacks; with LLAMA_CPP_ROOT it reads the
checkout's `conversion/`, and this script puts the checkout's `gguf-py` first on the path to match.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

if os.environ.get("LLAMA_CPP_ROOT"):  # AutoRound reads llama.cpp's conversion code from this checkout; its
    sys.path.insert(0, str(Path(os.environ["LLAMA_CPP_ROOT"]) / "gguf-py"))  # gguf-py must be the one it names

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

DEMO = Path(__file__).resolve().parents[2]
ROLES = ("gate", "up", "down")  # GGUF ffn_{role}_exps <-> transformers experts.{i}.{role}_proj
EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
IGNORE = "self_attn,shared_expert,mlp.gate,lm_head,embed_tokens"  # substrings AutoRound matches in layer
# names (shared_expert takes mlp.shared_expert_gate too; AutoRound leaves the router, mlp.gate, alone by
# itself and warns that this entry matches nothing). The unfused experts are mlp.experts.{i}.{role}_proj.
TUNED_LINE = re.compile(r"quantized (\d+)/(\d+) layers in the block, loss iter 0: (\S+) -> iter (\d+): (\S+)")
MIN_CODE_CHANGE = 0.02  # least share of 2-bit codes that tuning must move away from plain rounding


def gguf_value(reader: GGUFReader, key: str) -> int:
    """An integer metadata value of the GGUF."""
    field = reader.fields[key]
    return int(field.parts[field.data[0]][0])


def build_checkpoint(reference: Path, out: Path) -> tuple[Path, int, int]:
    """A float32 transformers checkpoint of the GGUF reference in `out`; (out, layers, experts).

    transformers' GGUF loader (5.x) leaves out `expert_feed_forward_length` and
    `expert_shared_feed_forward_length`, so they come from the file's keys. The loaded model does not
    save directly; its state dict does."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    reader = GGUFReader(reference)
    arch = reader.fields["general.architecture"].contents()
    widths = {"moe_intermediate_size": gguf_value(reader, f"{arch}.expert_feed_forward_length")}
    if f"{arch}.expert_shared_feed_forward_length" in reader.fields:
        widths["shared_expert_intermediate_size"] = gguf_value(reader, f"{arch}.expert_shared_feed_forward_length")
    hf = AutoModelForCausalLM.from_pretrained(reference.parent, gguf_file=reference.name, dtype=torch.float32,
                                              **widths)
    n_layers, n_experts = hf.config.num_hidden_layers, hf.config.num_experts
    assert n_experts == gguf_value(reader, f"{arch}.expert_count")
    hf.config.architectures = [type(hf).__name__]  # the GGUF loader leaves it out; AutoRound's GGUF
    hf.config.save_pretrained(out)  # layer defaults look the architecture up by it
    save_file({k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}, out / "model.safetensors")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(DEMO / "tokenizer.json"), eos_token="<|endoftext|>")
    tok.save_pretrained(out)
    return out, n_layers, n_experts


def trace_sequences(cal_trace: Path) -> list[dict[str, torch.Tensor]]:
    """The calibration trace's sequences (trace "calibration" of a published `cal_trace` table), in
    order, as AutoRound's token dataset: the tokens our dump and llama.cpp's imatrix saw."""
    import pyarrow.parquet as pq

    table = pq.read_table(cal_trace, columns=["trace", "seq", "pos", "token"]).to_pylist()
    seqs: dict[int, list[tuple[int, int]]] = {}
    for row in table:
        if row["trace"] == "calibration":
            seqs.setdefault(row["seq"], []).append((row["pos"], row["token"]))
    assert seqs, f"{cal_trace}: no calibration trace"
    out = []
    for seq in sorted(seqs):
        ids = torch.tensor([t for _, t in sorted(seqs[seq])], dtype=torch.int64)[None]  # (1, L)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    lengths = {int(s["input_ids"].shape[1]) for s in out}
    assert len(lengths) == 1, f"{cal_trace}: sequences of unequal lengths {sorted(lengths)}"
    print(f"calibration: the lake's trace, {len(out)} sequences of {lengths.pop()} tokens")
    return out


def calibration_chunks(docs: Path, split: Path, tokenizer: Path, seqlen: int, nsamples: int,
                       seed: int) -> list[dict[str, torch.Tensor]]:
    """`nsamples` chunks of `seqlen` tokens of the `cal` documents, as AutoRound takes a token dataset."""
    from tokenizers import Tokenizer

    with split.open() as f:
        cal = {row["doc_id"] for row in csv.DictReader(f) if row["role"] == "cal"}
    texts = {}
    with docs.open() as f:
        for line in f:
            doc = json.loads(line)
            if doc["doc_id"] in cal:
                texts[doc["doc_id"]] = doc["text"]
    assert set(texts) == cal, f"{docs}: missing cal documents {sorted(cal - set(texts))[:3]}"
    tok = Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for doc_id in sorted(texts):
        stream += tok.encode(texts[doc_id], add_special_tokens=False).ids + [eot]
    ids = np.asarray(stream, np.int64)[: len(stream) // seqlen * seqlen].reshape(-1, seqlen)  # (C, seqlen)
    assert len(ids) >= nsamples, f"only {len(ids)} chunks of {seqlen} tokens in the cal documents"
    pick = np.sort(np.random.default_rng(seed).permutation(len(ids))[:nsamples])  # (nsamples,)
    print(f"calibration: {len(cal)} cal documents, {len(stream)} tokens, {len(ids)} chunks of {seqlen}; "
          f"{nsamples} chunks used ({nsamples * seqlen} tokens)")
    return [{"input_ids": torch.from_numpy(ids[i : i + 1]),  # (1, seqlen)
             "attention_mask": torch.ones(1, seqlen, dtype=torch.int64)} for i in pick]


class LogTap(logging.Handler):
    """Keeps AutoRound's log messages so the script can check what it says it tuned."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def expert_layer(model: torch.nn.Module, layer: int, expert: int, role: str) -> torch.nn.Module:
    """The unfused linear layer of one routed expert (AutoRound replaces the fused 3-D parameters)."""
    return model.get_submodule(f"model.layers.{layer}.mlp.experts.{expert}.{role}_proj")


def pack_tuned(module: torch.nn.Module) -> np.ndarray:
    """AutoRound's Q2_K bytes of one tuned linear layer, (rows, 84 * cols / 256), from its tuned
    scales and mins, exactly as its GGUF export packs a layer."""
    from auto_round.export.export_to_gguf.packing import ggml_quant

    f32 = lambda t: t.to(torch.float32)  # noqa: E731 - the export hands the packer float32 parameters
    return ggml_quant(module.weight.detach().clone(), "q2_k", scale=f32(module.scale), zp=None,
                      wmin=f32(module.w_wmin), d_scale=f32(module.w_d_scale), d_wmin=f32(module.w_d_wmin),
                      device="cpu")


def pack_rtn(weight: torch.Tensor) -> np.ndarray:
    """AutoRound's plain rounding of the same scheme (no tuning, no imatrix): the skip baseline."""
    from auto_round.export.export_to_gguf.packing import ggml_quant

    return ggml_quant(weight.detach().clone(), "q2_k", device="cpu")


def q2_k_codes(blocks: np.ndarray) -> np.ndarray:
    """The 2-bit codes of Q2_K blocks (..., 84): bytes 16..80 hold four codes each."""
    qs = blocks[..., 16:80]  # (..., 64)
    return np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], -1)  # (..., 64, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, default=DEMO / "model" / "demo-q8_0.gguf")
    parser.add_argument("--base", type=Path, default=DEMO / "peers" / "q2_k_imatrix.gguf",
                        help="llama.cpp's Q2_K peer whose routed experts are replaced")
    parser.add_argument("--out", type=Path, default=DEMO / "peers" / "q2_k_autoround.gguf")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a published cal_trace.parquet (lake/current/tables/): calibrate on exactly "
                             "its calibration sequences instead of nsamples x seqlen chunks of the cal documents")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summary", type=Path, default=Path(__file__).with_name("last_run.json"),
                        help="versions, settings, wall time, AutoRound's per-block log and the checks")
    args = parser.parse_args()
    if not os.environ.get("LLAMA_CPP_ROOT"):
        parser.error("set LLAMA_CPP_ROOT to a llama.cpp source checkout: AutoRound 0.16.1's bundled converter "
                     "names architectures that gguf 0.19.0 lacks; it reads the checkout's conversion code and gguf-py")
    args = argparse.Namespace(**{k: v.resolve() if isinstance(v, Path) else v for k, v in vars(args).items()})
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tap = LogTap()
    logging.getLogger("autoround").addHandler(tap)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):  # AutoRound keeps its offload
        # folder (ar_work_space) under the working directory; the caller's comes back before tmp goes
        ckpt, n_layers, n_experts = build_checkpoint(args.reference, Path(tmp))
        if args.trace is not None:
            dataset = trace_sequences(args.trace)
            args.nsamples, args.seqlen = len(dataset), int(dataset[0]["input_ids"].shape[1])
        else:
            dataset = calibration_chunks(DEMO / "docs.jsonl", DEMO / "split.csv", DEMO / "tokenizer.json",
                                         args.seqlen, args.nsamples, args.seed)
        start = time.perf_counter()
        ar = AutoRound(str(ckpt), AutoTokenizer.from_pretrained(ckpt), scheme="gguf:q2_k_s", iters=args.iters,
                       nsamples=args.nsamples, seqlen=args.seqlen, dataset=dataset, enable_alg_ext=True,
                       ignore_layers=IGNORE, seed=args.seed, device_map="cpu")
        model, _ = ar.quantize()
        seconds = time.perf_counter() - start
        print(f"AutoRound: {seconds:.0f} s wall on {args.threads} thread(s)")
        said = check_log(tap.lines, n_layers, n_experts)
        summary = {"versions": {m: metadata.version(m) for m in ("auto-round", "torch", "transformers")},
                   "gguf_py": str(Path(gguf.__file__).parents[1]),
                   "settings": {k: getattr(args, k) for k in ("iters", "nsamples", "seqlen", "seed", "threads")},
                   "calibration": "cal_trace" if args.trace is not None else "cal documents",
                   "wall_seconds": round(seconds), "autoround_log": said, "tensors": {}}
        tuned = pack_experts(model, load_file(ckpt / "model.safetensors"), n_layers, n_experts, summary["tensors"])
    write_peer(args.base, args.out, tuned)
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")


def check_log(lines: list[str], n_layers: int, n_experts: int) -> list[str]:
    """AutoRound's per-block lines, checked: every block tuned every routed expert layer and lowered
    the block's output loss from the start (iteration 0) to the iterate it kept."""
    said = [line for line in lines if TUNED_LINE.search(line)]
    print("AutoRound log:", *said, sep="\n  ")
    assert len(said) == n_layers, f"AutoRound reported {len(said)} tuned blocks of {n_layers}"
    for line in said:
        n, _, loss0, best, loss = TUNED_LINE.search(line).groups()
        assert int(n) >= 3 * n_experts, f"fewer than {3 * n_experts} layers tuned: {line}"
        assert int(best) > 0 and float(loss) < float(loss0), f"tuning did not lower the block's loss: {line}"
    return said


def pack_experts(model: torch.nn.Module, original: dict[str, torch.Tensor], n_layers: int, n_experts: int,
                 report: dict) -> dict[str, np.ndarray]:
    """Each routed-expert GGUF tensor's Q2_K blocks (E, out, 84 * in / 256), packed from AutoRound's tuned
    layers and checked against its fake-quantized weights (gguf-py decodes them) and against plain
    rounding of the reference weights (`original`, the checkpoint's fused tensors)."""
    tuned: dict[str, np.ndarray] = {}
    for layer in range(n_layers):
        gate_up = original[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # (E, 2I, d)
        width = gate_up.shape[1] // 2
        reference = {"gate": gate_up[:, :width], "up": gate_up[:, width:],  # (E, I, d)
                     "down": original[f"model.layers.{layer}.mlp.experts.down_proj"]}  # (E, d, I)
        for role in ROLES:
            name = f"blk.{layer}.ffn_{role}_exps.weight"
            packed, rtn, qdq = [], [], []
            for e in range(n_experts):
                module = expert_layer(model, layer, e, role)
                assert all(getattr(module, a, None) is not None for a in ("scale", "w_wmin", "w_d_scale",
                                                                        "w_d_wmin")), \
                    f"{name} expert {e}: no tuned Q2_K parameters (AutoRound skipped the layer)"
                packed.append(pack_tuned(module))  # (out, 84 * in / 256)
                rtn.append(pack_rtn(reference[role][e]))  # (out, 84 * in / 256)
                qdq.append(module.weight.detach().to(torch.float32).numpy())  # (out, in)
            blocks = np.stack(packed).astype(np.uint8)  # (E, out, 84 * in / 256)
            fake = np.stack(qdq)  # (E, out, in)
            decoded = dequantize(blocks, GGMLQuantizationType.Q2_K)  # (E, out, in)
            err = float(np.abs(decoded - fake).max() / np.abs(fake).max())
            moved = float((q2_k_codes(blocks) != q2_k_codes(np.stack(rtn))).mean())
            print(f"{name}: decoded vs fake-quantized max rel err {err:.2e}; "
                  f"{moved:.1%} of codes differ from plain rounding")
            assert err <= 1e-3, f"{name}: packed bytes do not decode to AutoRound's weights ({err:.2e})"
            assert moved >= MIN_CODE_CHANGE, f"{name}: only {moved:.1%} of codes moved from plain rounding"
            tuned[name] = blocks
            report[name] = {"decode_max_rel_err": err, "codes_moved_from_rtn": moved}
    return tuned


def write_peer(base: Path, out: Path, tuned: dict[str, np.ndarray]) -> None:
    """Copy `base` to `out` and overwrite the routed-expert tensors in place; check the result."""
    shutil.copyfile(base, out)
    writer = GGUFReader(out, "r+")
    for t in writer.tensors:
        if EXPERT_TENSOR.fullmatch(t.name):
            assert t.tensor_type == GGMLQuantizationType.Q2_K and t.data.shape == tuned[t.name].shape, t.name
            t.data[...] = tuned[t.name]
    writer.data.flush()
    del writer
    src, got = GGUFReader(base), GGUFReader(out)
    replaced = 0
    for a, b in zip(src.tensors, got.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.shape) == (b.name, b.tensor_type, b.data.shape)
        if a.name in tuned:
            assert np.array_equal(b.data, tuned[a.name]) and not np.array_equal(a.data, b.data), a.name
            replaced += 1
        else:
            assert np.array_equal(a.data, b.data), a.name
    assert replaced == len(tuned)
    print(f"wrote {out}: {replaced} routed-expert tensors replaced, every other tensor as in {base.name}")


if __name__ == "__main__":
    main()
