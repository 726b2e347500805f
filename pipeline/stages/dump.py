"""The `dump` stage: the reference model's MoE activations over one trace, streamed into chunked Zarr
(the format and its reading: `pipeline/data/dumps.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import dump_trace
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.runner import Runner


@dataclass(frozen=True)
class DumpParams:
    """Which trace, in sequences of how many tokens; whether the attention inputs are captured and
    the arrays' dtype (None: no and float32, so other configs' dumps keep their fingerprints).
    `chunk_tokens` only sets how many tokens a forward pass holds: the dump is the same."""

    trace: str
    seq_tokens: int
    chunk_tokens: int = field(metadata={"fingerprint": False})
    attention_inputs: bool | None = None  # True or None
    dump_dtype: str | None = None  # None: float32


def build_dump(out: Path, params: DumpParams, *, reference: Path, traces: Path, log: Log) -> None:
    """The dump stage: the `reference` model run over one trace of the traces stage's output (`traces`)."""
    tokens, seq = trace_tokens(traces, params.trace)
    dump_trace(out, Runner(open_model(reference)), tokens, seq, params.trace, params.chunk_tokens,
               params.seq_tokens, log, bool(params.attention_inputs), params.dump_dtype or "float32")


STAGE = Stage("dump", "dumps", build_dump, suffix=".zarr", outputs=("routing",), resumable=True)
