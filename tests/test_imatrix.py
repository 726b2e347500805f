"""The importance-matrix GGUF reads back with gguf-py as llama.cpp lays it out."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.imatrix import write_imatrix


def field_value(reader: gguf.GGUFReader, key: str):
    """A scalar or string-array field's value."""
    return reader.fields[key].contents()


def test_round_trip_with_gguf_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n_expert, d_model, d_expert = 8, 64, 32
    stats = {
        "blk.1.ffn_up_exps.weight": (rng.gamma(1.0, 5.0, (n_expert, d_model)), np.arange(n_expert) * 7.0),
        "blk.0.ffn_down_exps.weight": (rng.gamma(1.0, 5.0, (n_expert, d_expert)), rng.integers(0, 100, n_expert)),
        "blk.0.attn_q.weight": (rng.gamma(1.0, 5.0, d_model), np.array(512.0)),
    }
    out = tmp_path / "imatrix.gguf"
    write_imatrix(out, stats, chunk_count=3, datasets=["cal.jsonl"], chunk_size=256)

    reader = gguf.GGUFReader(out)
    assert field_value(reader, "general.type") == "imatrix"
    assert field_value(reader, "imatrix.chunk_count") == 3
    assert field_value(reader, "imatrix.chunk_size") == 256
    assert field_value(reader, "imatrix.datasets") == ["cal.jsonl"]
    assert reader.fields["imatrix.chunk_count"].types == [gguf.GGUFValueType.UINT32]

    tensors = {t.name: t for t in reader.tensors}
    expected_names = [f"{n}.{s}" for n in sorted(stats) for s in ("in_sum2", "counts")]
    assert [t.name for t in reader.tensors] == expected_names  # sorted, as llama-imatrix writes
    for name, (sums, counts) in stats.items():
        n_mat = np.asarray(sums).reshape(-1, np.asarray(sums).shape[-1]).shape[0]
        cols = np.asarray(sums).shape[-1]
        t_sums, t_counts = tensors[f"{name}.in_sum2"], tensors[f"{name}.counts"]
        assert t_sums.tensor_type == gguf.GGMLQuantizationType.F32
        assert t_counts.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(t_sums.shape) == [cols, n_mat]  # ggml order: ne0 = cols
        assert list(t_counts.shape) == [1, n_mat]
        np.testing.assert_array_equal(np.asarray(t_sums.data).reshape(n_mat, cols), np.asarray(sums, np.float32).reshape(n_mat, cols))
        np.testing.assert_array_equal(np.asarray(t_counts.data).reshape(n_mat), np.asarray(counts, np.float32).reshape(n_mat))
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind


def test_bad_statistics_leave_the_old_file_alone(tmp_path: Path) -> None:
    out = tmp_path / "imatrix.gguf"
    good = {"blk.0.ffn_up_exps.weight": (np.ones((4, 16)), np.ones(4))}
    write_imatrix(out, good, chunk_count=1, datasets=["a"])
    before = out.read_bytes()
    bad_cases = [
        ({"blk.0.ffn_up_exps.weight": (np.full((4, 16), np.nan), np.ones(4))}, "non-finite"),
        ({"blk.0.ffn_up_exps.weight": (np.ones((4, 16)), np.ones(3))}, "counts"),
        ({"blk.0.ffn_up_exps.weight": (np.ones(16), np.ones(1))}, "per-expert"),
        ({"blk.0.attn_q.weight": (-np.ones(16), np.ones(1))}, "negative"),
    ]
    for stats, message in bad_cases:
        with pytest.raises(InputError, match=message):
            write_imatrix(out, stats, chunk_count=1, datasets=["b"])
    assert out.read_bytes() == before
    assert list(tmp_path.iterdir()) == [out]
