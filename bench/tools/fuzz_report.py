"""Reliability under damaged inputs: `bench/inputs/damage.py`'s generators over more seeds, totals per kind.

    JAX_PLATFORMS=cpu .venv/bin/python bench/tools/fuzz_report.py [--seeds N] [--cli N] [--demo N]

In-process, each case calls the validating open/read function (as
`tests/test_fuzz.py` does) and is counted as rejected (one-line InputError
naming the file), accepted (the damage left a valid file) or crash (any other
exception, a message that does not say where, or a damage that can never be
valid going through). With `--cli N`, the first N command-line cases also run
as `python -m moeheal` in their own process on a small world with a published
lake: exit codes, tracebacks on stderr, and whether the lake's tables/ and
lake.duckdb changed by a single byte. With `--demo N`, N header corruptions
of the bundled demo GGUF (8192-token vocabulary) are opened the same way.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.inputs import damage as fuzz  # noqa: E402
from bench.inputs.ggufs import make_tiny_gguf  # noqa: E402


def in_process(work: Path, seeds: int) -> dict[str, collections.Counter]:
    tiny = make_tiny_gguf(work / "tiny.gguf", arch="qwen2moe", seed=0)
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with fuzz.small_line_limit():
        for case in fuzz.all_cases(tiny, work / "cases", range(seeds)):
            outcome = fuzz.run_case(case)
            totals[outcome.kind][outcome.result] += 1
            if outcome.result == "crash":
                print(f"  crash: {case.kind} seed {case.seed}: {outcome.detail[:200]}", file=sys.stderr)
    return totals


def demo_headers(work: Path, n: int) -> dict[str, collections.Counter]:
    """The bundled demo model's header damaged n times: flips, zeroed runs, truncation in turn."""
    from moeheal.pipeline.gguf.model import GGUFModel
    from bench.inputs.ggufs import corrupt_header

    demo = REPO / "demo" / "model" / "demo-q8_0.gguf"
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for seed in range(n):
        how = fuzz.GGUF_KINDS[seed % len(fuzz.GGUF_KINDS)]
        dst = corrupt_header(demo, work / "demo.gguf", how, seed)
        case = fuzz.Case(f"demo_gguf_{how}", seed, (dst.name,), lambda: GGUFModel(dst).tokenizer(), how == "truncate")
        outcome = fuzz.run_case(case)
        unchanged = dst.stat().st_size == demo.stat().st_size and dst.read_bytes() == demo.read_bytes()
        totals[outcome.kind]["unchanged" if unchanged else outcome.result] += 1  # zeros written over zeros
        if outcome.result != "rejected" and not unchanged:
            print(f"  {outcome.result}: {case.kind} seed {seed}: {outcome.detail[:200]}", file=sys.stderr)
    return totals


def command_line(work: Path, n: int) -> dict[str, collections.Counter]:
    from moeheal.pipeline.commands.cli import main
    from moeheal.pipeline.lake.store import Lake
    from bench.inputs.healworld import write_world

    import pyarrow as pa

    config = write_world(work / "world")
    assert main(["audit", "-c", str(config)]) == 0
    Lake(config.parent / "lake").write_table("docs", pa.table({"doc_id": ["published"], "n_tokens": [1]}))
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for index in range(n):
        kind = fuzz.CLI_KINDS[index % len(fuzz.CLI_KINDS)]
        argv, name, expect = fuzz.cli_case(config, index)
        before = fuzz.lake_digest(config.parent / "lake")
        proc = subprocess.run([sys.executable, "-m", "moeheal", *argv], capture_output=True, text=True,
                              timeout=600, cwd=REPO)
        err = proc.stderr.strip().splitlines()
        counts = totals[f"cli_{kind}"]
        counts[f"exit {proc.returncode}"] += 1
        counts["traceback"] += "Traceback" in proc.stderr
        counts["not one line naming it"] += bool(proc.returncode) and not (len(err) == 1 and name in err[0])
        counts["lake changed"] += fuzz.lake_digest(config.parent / "lake") != before
    return totals


def print_table(title: str, totals: dict[str, collections.Counter], columns: list[str]) -> None:
    print(f"\n{title}\n")
    print("| kind | cases | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    grand: collections.Counter = collections.Counter()
    for kind in sorted(totals):
        counts = totals[kind]
        cases = sum(v for k, v in counts.items() if k in columns and not k.startswith(("traceback", "not ", "lake")))
        cases = cases or sum(counts.values())
        grand.update(counts)
        grand["cases"] += cases
        print(f"| {kind} | {cases} | " + " | ".join(str(counts[c]) for c in columns) + " |")
    print(f"| **all** | **{grand['cases']}** | " + " | ".join(f"**{grand[c]}**" for c in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=150, help="seeds per generator (fuzz.CASES_PER_SEED cases per seed)")
    parser.add_argument("--cli", type=int, default=len(fuzz.CLI_KINDS), help="command-line cases")
    parser.add_argument("--demo", type=int, default=24, help="header corruptions of the demo GGUF")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.time()
        totals = in_process(work, args.seeds)
        print_table(f"In-process ({args.seeds} seeds, {time.time() - start:.0f} s)", totals,
                    ["rejected", "accepted", "crash"])
        if args.demo:
            start = time.time()
            demo = demo_headers(work, args.demo)
            print_table(f"Demo GGUF headers ({args.demo} cases, {time.time() - start:.0f} s)", demo,
                        ["rejected", "accepted", "unchanged", "crash"])
        if args.cli:
            start = time.time()
            cli = command_line(work, args.cli)
            exits = sorted({k for c in cli.values() for k in c if k.startswith("exit")})
            print_table(f"Command line ({args.cli} cases, {time.time() - start:.0f} s)", cli,
                        exits + ["traceback", "not one line naming it", "lake changed"])


if __name__ == "__main__":
    main()
