"""Streaming Zarr dumps: chunking changes no byte, a killed dump resumes, NaN is refused."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from bench.inputs.dump_reference import sequential_dump
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model import runner as runner_module
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.data import dumps
from moeheal.pipeline.data.dumps import (
    ARRAYS,
    chunk_sequences,
    dump_trace,
    forward_batches,
    import_raw_dump,
    open_dump,
    read_routing,
)

SEQ = 64
REPO = Path(__file__).resolve().parents[1]


def trace(vocab: int, n_tokens: int = 5 * SEQ + 17, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, vocab, n_tokens).astype(np.int32)
    return tokens, (np.arange(n_tokens) // SEQ).astype(np.int32)


def array_files(dump: Path) -> dict[str, bytes]:
    """Every stored byte of the dump except the routing parts (compared as a table)."""
    return {str(p.relative_to(dump)): p.read_bytes() for p in sorted(dump.rglob("*"))
            if p.is_file() and "routing" not in p.parts}


def test_chunking_changes_no_byte(tiny_qwen2moe, tmp_path):
    model = GGUFModel(tiny_qwen2moe)
    runner = Runner(model)
    tokens, seq = trace(model.hp.vocab_size, n_tokens=9 * SEQ + 17)  # 10 sequences; chunks of 2 round up to 4
    dump_trace(tmp_path / "one.zarr", runner, tokens, seq, "calibration", chunk_tokens=12 * SEQ, seq_tokens=SEQ)
    dump_trace(tmp_path / "three.zarr", runner, tokens, seq, "calibration", chunk_tokens=2 * SEQ, seq_tokens=SEQ)
    one, three = array_files(tmp_path / "one.zarr"), array_files(tmp_path / "three.zarr")
    assert one.keys() == three.keys() and all(one[k] == three[k] for k in one)
    assert len(list((tmp_path / "three.zarr" / "routing").iterdir())) == 3
    assert read_routing(tmp_path / "one.zarr").equals(read_routing(tmp_path / "three.zarr"))
    group = open_dump(tmp_path / "one.zarr")["1"]
    assert group["mixed"].shape == (len(tokens), model.hp.d_model)
    assert group["hh"].shape == (len(tokens), model.hp.d_shexp)
    assert group.attrs["trace"] == "calibration"


def test_forward_batches_keep_the_order_and_a_fixed_size_whatever_the_chunk():
    """A dump runs each batch as one (B, T) pass: at most DUMP_BATCH_SEQS consecutive sequences of one
    length, cut at every DUMP_BATCH_SEQS-th from the first (a shorter one, a trace's last, alone), every
    row in its place; chunks hold whole batches, so the passes are the same for any chunk size."""
    bounds = [(64 * i, 64 * i + 64) for i in range(6)] + [(384, 401)]
    assert forward_batches(bounds) == [bounds[0:4], bounds[4:6], bounds[6:7]]
    assert [b for run in forward_batches(bounds) for b in run] == bounds
    assert forward_batches([]) == []
    assert [chunk_sequences(c, 64) for c in (1, 64, 4 * 64, 5 * 64, 8 * 64)] == [4, 4, 4, 8, 8]
    for chunk_tokens in (64, 2 * 64, 10 * 64):
        per = chunk_sequences(chunk_tokens, 64)
        assert [run for i in range(0, len(bounds), per) for run in forward_batches(bounds[i:i + per])] == \
            forward_batches(bounds)


def test_dump_rows_are_the_runner_captures(tiny_qwen2moe, tmp_path):
    model = GGUFModel(tiny_qwen2moe)
    runner = Runner(model)
    tokens, seq = trace(model.hp.vocab_size, n_tokens=2 * SEQ)
    dump_trace(tmp_path / "d.zarr", runner, tokens, seq, "unseen", chunk_tokens=SEQ, seq_tokens=SEQ)
    captured = {}
    runner.forward(tokens[None, SEQ:], capture=True,
                   on_layer=lambda layer, cap: captured.setdefault(layer, np.asarray(cap.yr)[0]))
    np.testing.assert_array_equal(open_dump(tmp_path / "d.zarr")["1"]["yr"][SEQ:], captured[1])


def test_killed_dump_resumes_without_gaps_or_duplicates(tiny_qwen2moe, tmp_path):
    model = GGUFModel(tiny_qwen2moe)
    tokens, seq = trace(model.hp.vocab_size, n_tokens=8 * SEQ)
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "seq.npy", seq)
    script = tmp_path / "dump.py"
    script.write_text(f"""
import sys, time
sys.path.append({str(REPO)!r})
import numpy as np
from pathlib import Path
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.model import runner as runner_module
from moeheal.pipeline.stages import dump
runner_module.LAYERWISE_STREAM_BYTES = 1  # a segment per chunk: `rows_done` moves chunk by chunk
slow = len(sys.argv) > 1
runner = Runner(GGUFModel({str(tiny_qwen2moe)!r}))
forward_layers = runner.forward_layers
def paced(*a, **k):
    out = forward_layers(*a, **k)
    if slow:
        time.sleep(0.3)
    return out
runner.forward_layers = paced
t = Path({str(tmp_path)!r})
dump.dump_trace(t / "d.zarr", runner, np.load(t / "tokens.npy"), np.load(t / "seq.npy"), "calibration", {SEQ}, {SEQ})
""")
    proc = subprocess.Popen([sys.executable, str(script), "slow"], env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin"})
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            done = zarr.open_group(str(tmp_path / "d.zarr"), mode="r").attrs.get("rows_done", 0)
        except Exception:  # not created yet
            done = 0
        if done >= 2 * SEQ:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    partial = zarr.open_group(str(tmp_path / "d.zarr"), mode="r").attrs
    assert 0 < partial["rows_done"] < len(tokens) and not partial.get("complete")
    subprocess.run([sys.executable, str(script)], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin"})
    dump_trace(tmp_path / "fresh.zarr", Runner(GGUFModel(tiny_qwen2moe)), tokens, seq, "calibration", SEQ, SEQ)
    resumed, fresh = open_dump(tmp_path / "d.zarr"), open_dump(tmp_path / "fresh.zarr")
    for layer in range(model.hp.n_layer):
        for name in ARRAYS:
            np.testing.assert_array_equal(resumed[str(layer)][name][:], fresh[str(layer)][name][:])
    routing = read_routing(tmp_path / "d.zarr")
    assert routing.num_rows == model.hp.n_layer * len(tokens) * model.hp.n_expert_used  # none missing, none twice
    assert routing.equals(read_routing(tmp_path / "fresh.zarr"))


def test_nan_names_layer_and_position(tiny_qwen2moe, tmp_path):
    model = GGUFModel(tiny_qwen2moe)
    up = model.tensor("blk.1.ffn_up_exps.weight").copy()
    up[:] = np.nan
    runner = Runner(model, overrides={"blk.1.ffn_up_exps.weight": up})
    tokens, seq = trace(model.hp.vocab_size, n_tokens=SEQ)
    with pytest.raises(InputError, match=r"layer 1: NaN or Inf in yr at token position 0"):
        dump_trace(tmp_path / "d.zarr", runner, tokens, seq, "calibration", SEQ, SEQ)


@pytest.mark.parametrize("dump_dtype, attention", [("float32", False), ("bfloat16", True)])
def test_dump_bytes_equal_the_sequential_writer(tiny_qwen2moe, tmp_path, dump_dtype, attention):
    """The writer thread, the uncopied float32 rows and the Arrow-built `trace` column change no stored
    byte: every file (chunks, metadata, routing parts) equals the one-chunk-at-a-time writer's, with two
    passes per chunk and a short last sequence."""
    runner = Runner(GGUFModel(tiny_qwen2moe))
    tokens, seq = trace(runner.hp.vocab_size, n_tokens=9 * SEQ + 17)
    sequential_dump(tmp_path / "ref.zarr", runner, tokens, seq, "unseen", 8 * SEQ, SEQ, attention, dump_dtype)
    dump_trace(tmp_path / "new.zarr", runner, tokens, seq, "unseen", 8 * SEQ, SEQ, attention_inputs=attention,
               dump_dtype=dump_dtype)
    ref, new = (
        {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
        for d in (tmp_path / "ref.zarr", tmp_path / "new.zarr"))
    assert sum(key.startswith("routing") for key in ref) == 2
    assert ref.keys() == new.keys() and [key for key in ref if ref[key] != new[key]] == []


def test_a_writer_error_surfaces_and_rows_done_stays_at_the_last_whole_segment(tiny_qwen2moe, tmp_path,
                                                                               monkeypatch):
    """A NaN in the second chunk (a segment of its own here) is found on the writer thread: the caller
    gets the InputError naming its position, `rows_done` stays at the first segment's end, and a resume
    writes the same bytes as a clean dump."""
    model = GGUFModel(tiny_qwen2moe)
    tokens, seq = trace(model.hp.vocab_size, n_tokens=8 * SEQ)  # two chunks of 4 sequences
    monkeypatch.setattr(runner_module, "LAYERWISE_STREAM_BYTES", 4 * SEQ * 4 * model.hp.d_model)  # a chunk's streams

    class NaNInSecondChunk(Runner):
        def forward_layers(self, batches, on_layer, after_layer=None):
            def poisoned(layer, b, cap):
                if layer == 1 and self.segments == 1:
                    yr = np.array(cap.yr)
                    yr[2, 5] = np.nan  # sequence 2 of the pass, its row 5
                    cap = dataclasses.replace(cap, yr=yr)
                on_layer(layer, b, cap)
            super().forward_layers(batches, poisoned, after_layer)
            self.segments += 1

    runner = NaNInSecondChunk(model)
    runner.segments = 0
    with pytest.raises(InputError, match=rf"layer 1: NaN or Inf in yr at token position {4 * SEQ + 2 * SEQ + 5}$"):
        dump_trace(tmp_path / "d.zarr", runner, tokens, seq, "calibration", 4 * SEQ, SEQ)
    attrs = zarr.open_group(str(tmp_path / "d.zarr"), mode="r").attrs
    assert attrs["rows_done"] == 4 * SEQ and not attrs.get("complete")
    assert [p.name for p in (tmp_path / "d.zarr" / "routing").iterdir()] == [f"{0:012d}.parquet"]
    clean = Runner(model)
    dump_trace(tmp_path / "d.zarr", clean, tokens, seq, "calibration", 4 * SEQ, SEQ)
    dump_trace(tmp_path / "fresh.zarr", clean, tokens, seq, "calibration", 4 * SEQ, SEQ)
    assert array_files(tmp_path / "d.zarr") == array_files(tmp_path / "fresh.zarr")
    assert read_routing(tmp_path / "d.zarr").equals(read_routing(tmp_path / "fresh.zarr"))


def test_a_dump_makes_each_layers_weights_once_per_segment(tiny_qwen2moe, tmp_path, monkeypatch):
    """The passes of a segment run layer by layer: every layer's tensors are made once per segment, not
    once per pass (a real layer's experts are GBs to dequantize onto the device), and the bytes are those
    of a dump cut into more segments."""
    model = GGUFModel(tiny_qwen2moe)
    tokens, seq = trace(model.hp.vocab_size, n_tokens=9 * SEQ + 17)  # 10 sequences: 3 passes

    class Counting(Runner):
        made = 0

        def layer_params(self, i):
            Counting.made += 1
            return super().layer_params(i)

    dump_trace(tmp_path / "one.zarr", Counting(model), tokens, seq, "calibration", 4 * SEQ, SEQ)
    assert Counting.made == model.hp.n_layer  # one segment, three passes
    Counting.made = 0
    monkeypatch.setattr(runner_module, "LAYERWISE_STREAM_BYTES", 4 * SEQ * 4 * model.hp.d_model)  # a chunk each
    dump_trace(tmp_path / "three.zarr", Counting(model), tokens, seq, "calibration", 4 * SEQ, SEQ)
    assert Counting.made == 3 * model.hp.n_layer
    one, three = (
        {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
        for d in (tmp_path / "one.zarr", tmp_path / "three.zarr"))
    assert one.keys() == three.keys() and [key for key in one if one[key] != three[key]] == []
    chunks = [[(i * SEQ, i * SEQ + SEQ)] for i in range(6)]
    assert dumps.segments(chunks, 2 * SEQ) == [chunks[0:2], chunks[2:4], chunks[4:6]]
    assert dumps.segments(chunks, 1) == [[c] for c in chunks]  # a chunk alone where none fits


def test_import_checks_sizes_against_T(tmp_path):
    T, d, f, k = 10, 8, 4, 2
    rng = np.random.default_rng(0)
    arrays = {"mixed": rng.normal(size=(T, d)), "yr": rng.normal(size=(T, d)), "hh": rng.normal(size=(T, f)),
              "experts": rng.integers(0, 4, (T, k)), "weights": rng.random((T, k))}
    for name, values in arrays.items():
        values.astype("<i4" if name == "experts" else "<f4").tofile(tmp_path / f"{name}.bin")
    spec = tmp_path / "dump.toml"
    layer = "\n".join(f'{name} = "{name}.bin"' for name in arrays)
    spec.write_text(f"trace = \"calibration\"\nT = {T}\nd = {d}\nf = {f}\nk = {k}\n[[layers]]\n{layer}\n")
    import_raw_dump(spec, tmp_path / "ok.zarr")
    group = open_dump(tmp_path / "ok.zarr")["0"]
    np.testing.assert_array_equal(group["mixed"][:], arrays["mixed"].astype(np.float32))
    assert pq.read_table(next((tmp_path / "ok.zarr" / "routing").iterdir())).num_rows == T * k
    (tmp_path / "hh.bin").write_bytes((tmp_path / "hh.bin").read_bytes()[:-4])
    with pytest.raises(InputError, match=r"hh.bin: layer 0 hh: 156 bytes, expected 160"):
        import_raw_dump(spec, tmp_path / "bad.zarr")
    assert not (tmp_path / "bad.zarr").exists()
