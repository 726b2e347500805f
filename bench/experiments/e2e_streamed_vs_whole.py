"""The streamed e2e stage against the whole-model stage it replaced, on the same file, same traces.

    .venv/bin/python bench/experiments/e2e_streamed_vs_whole.py [-c demo/heal.toml] [--variant q2_k_learned_e2e]
                                                                [--before 93daa35] [--json bench/results/e2e-topk/streamed_vs_whole.json]

The whole-model stage (`pipeline/stages/e2e.py` and `kernels/e2e.py` at commit `--before`, read from
this repository's history) and today's streamed stage with k = the vocabulary (its loss is then the
full KL) each tune the variant's assembled GGUF from the config's lake (after `moeheal heal`) with the
variant's knobs, and the script prints both curves (KL on the unseen trace and on the calibration
probe at every measured step), their largest relative difference and the two kept steps. The
reference's distribution for the streamed stage comes from the `reference-topk` stage at k = the
vocabulary, built here if the lake lacks it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after site-packages: DESIGN.md, Imports

from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.gguf.model import open_model  # noqa: E402
from moeheal.pipeline.heal import HealRun  # noqa: E402
from moeheal.pipeline.model.runner import Runner  # noqa: E402
from moeheal.pipeline.model import tuner  # noqa: E402
from moeheal.pipeline.stages import e2e  # noqa: E402
from moeheal.pipeline.data.documents import trace_tokens  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def module_at(commit: str, path: str, name: str, replace: dict[str, str] | None = None) -> types.ModuleType:
    """The module `path` as it was at `commit`, loaded under `name` (its imports edited by `replace`)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{path}"], check=True,
                            capture_output=True, text=True).stdout
    for old, new in (replace or {}).items():
        source = source.replace(old, new)
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/heal.toml"))
    parser.add_argument("--variant", default="q2_k_learned_e2e")
    parser.add_argument("--before", default="93daa35", help="the commit whose e2e stage is the whole-model one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run = HealRun(load_config(args.config), log=lambda line: None)
    variant = next(v for v in run.cfg.healed_variants if v.name == args.variant)
    params = e2e.E2EParams.of(variant, run.cfg.seq_tokens)
    assembled, traces = open_model(run.result(run.assemble(variant)).path), run.result(run.traces()).path
    vocab = run.reference.hp.vocab_size

    module_at(args.before, "kernels/e2e.py", "whole_kernels_e2e")
    whole = module_at(args.before, "pipeline/stages/e2e.py", "whole_stage_e2e",
                      {"from moeheal.kernels.e2e import": "from whole_kernels_e2e import"})
    runner = Runner(run.reference)
    cal, unseen = (whole.Trace(runner, *trace_tokens(traces, name), run.cfg.seq_tokens) for name in ("calibration", "unseen"))
    del runner
    _, curve_whole = whole.tune(whole.Tuner(assembled, run.source), cal, unseen, params, log=lambda line: None)

    topk = run.result(run.reference_topk(vocab)).path
    cal, unseen = (tuner.Trace(*trace_tokens(traces, name), run.cfg.seq_tokens, topk, name) for name in ("calibration", "unseen"))
    _, curve_streamed = e2e.tune(tuner.Tuner(assembled, run.source), cal, unseen, params, log=lambda line: None)

    def kept(curve: list[dict]) -> int:
        held = {r["step"]: r["kl"] for r in curve if r["split"] == "unseen"}
        return min(held, key=lambda s: (held[s], s))

    print(f"{args.variant}: {params.steps} steps, vocabulary {vocab}; whole-model stage at {args.before}, streamed now")
    print("| step | split | whole-model KL | streamed KL (k = vocabulary) | relative difference |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for a, b in zip(curve_whole, curve_streamed, strict=True):
        assert (a["step"], a["split"]) == (b["step"], b["split"])
        diff = b["kl"] / a["kl"] - 1
        worst = max(worst, abs(diff))
        print(f"| {a['step']} | {a['split']} | {a['kl']:.6f} | {b['kl']:.6f} | {diff:+.2e} |")
    print(f"largest relative difference {worst:.2e}; kept step: whole-model {kept(curve_whole)}, "
          f"streamed {kept(curve_streamed)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "whole": curve_whole,
                                         "streamed": curve_streamed, "largest_relative_difference": worst,
                                         "kept": {"whole": kept(curve_whole), "streamed": kept(curve_streamed)}},
                                        indent=1))


if __name__ == "__main__":
    main()
