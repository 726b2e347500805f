"""A `jax.profiler` trace of a benchmark's timed region, summarised where it ran.

    with traced(Path("trace_dir"), "learned step") as summary:
        run_steps()
    print(summary.text)

A GPU trace is tens of megabytes of protobuf; what a reader needs is where the
device's time went: per device stream the kernels by total time, the stream's
busy time (the union of its kernels' intervals) against the region's wall time,
and on the host the busiest named events (Python dispatch, transfers,
compilation). `summarise` reads the Chrome-trace JSON that `jax.profiler.trace`
writes with `create_perfetto_trace=True` (no TensorBoard needed) and returns
that table as text, so only a few kilobytes come back from a remote machine.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

TOP = 25  # events listed per process


@dataclass
class Summary:
    """The summary's text, filled in when the traced region ends."""

    label: str
    text: str = ""


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_us, end_us) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total / 1e6


def summarise(trace_json: Path, wall_s: float, label: str = "", top: int = TOP) -> Summary:
    """Per process of the trace (a device's streams, the host's threads): its events by total duration, and
    the time they cover (the union of their intervals) against ``wall_s``."""
    with gzip.open(trace_json, "rt") if trace_json.suffix == ".gz" else open(trace_json) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        row = totals[e["pid"]][e["name"]]
        row[0] += e["dur"] / 1e6
        row[1] += 1
        spans[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    out = Summary(label)
    lines = [f"## trace: {label} ({wall_s:.3f} s wall)"]
    for pid, by_name in sorted(totals.items(), key=lambda kv: -sum(v[0] for v in kv[1].values())):
        pname = names.get(pid, str(pid))
        busy = _union_s(spans[pid])
        lines.append(f"\n### {pname}: events cover {busy:.3f} s ({100 * busy / max(wall_s, 1e-9):.0f}% of wall)")
        lines.append("| event | total s | count | mean ms |")
        lines.append("|---|---|---|---|")
        for name, (total, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| {name[:90]} | {total:.4f} | {count} | {1e3 * total / count:.3f} |")
    out.text = "\n".join(lines)
    return out


@contextmanager
def traced(log_dir: Path | None, label: str) -> Iterator[Summary]:
    """Trace the body with `jax.profiler` into ``log_dir`` and summarise it on exit (nothing without a dir)."""
    summary = Summary(label)
    if log_dir is None:
        yield summary
        return
    import jax

    log_dir.mkdir(parents=True, exist_ok=True)
    before = set(log_dir.rglob("perfetto_trace.json.gz"))
    start = time.perf_counter()
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        yield summary
        jax.effects_barrier()
    wall = time.perf_counter() - start
    made = sorted(set(log_dir.rglob("perfetto_trace.json.gz")) - before)
    if made:
        done = summarise(made[-1], wall, label)
        summary.text = done.text
    else:
        summary.text = f"## trace: {label}: the profiler wrote no perfetto trace under {log_dir}"
