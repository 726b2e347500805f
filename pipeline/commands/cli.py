"""`moeheal` command line: parse, load the config, call the pipeline, print a summary.

Errors a user can cause end here as one line on stderr and the contract's exit
code (2 bad input, 3 audit violation); everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moeheal import __version__
from moeheal.pipeline.errors import InputError, MoehealError
from moeheal.pipeline.model.compile_cache import prepare_compilation

if TYPE_CHECKING:
    from moeheal.pipeline.config import Config


# The commands that read the outside (peer) GGUFs a config names: `heal` and `eval` evaluate them,
# `calibrate` tabulates them (`variants`, `recipe`, `sizes`), `plan` fingerprints them. They need every
# peer made. The others read none, so they run before a peer is made: an audit before the peers, the
# `imatrix` and `recipe` that help make one.
READS_PEERS = ("heal", "plan", "calibrate", "eval")


def _config(args: argparse.Namespace) -> Config:
    """The command's config: for a command that reads the peers, all of them (one missing is one
    line naming the file and its config key, exit 2); for the others, less those not made yet."""
    from moeheal.pipeline.config import load_config, without_unmade_peers

    if args.command in READS_PEERS:
        return load_config(args.config)
    return without_unmade_peers(load_config(args.config, peers_may_be_missing=True))


def _pipeline(args: argparse.Namespace, plan: bool = False):
    from moeheal.pipeline.heal import HealRun
    from moeheal.pipeline.lake.gc import heal_lock

    run = HealRun(_config(args), plan=plan)
    if not plan:  # a command that writes the lake holds it to its end: `moeheal lake gc` waits for it
        args.held.enter_context(heal_lock(run.lake.root, on_wait=lambda message: print(message, file=sys.stderr)))
    return run


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard I/N`` as (I, N), 0 <= I < N; InputError (one line, exit 2) otherwise."""
    index, _, count = text.partition("/")
    try:
        shard, shards = int(index), int(count)
    except ValueError:
        shard, shards = -1, 0
    if not 0 <= shard < shards:
        raise InputError(f"--shard {text}: expected I/N, worker I of N, with 0 <= I < N (e.g. 0/4)")
    return shard, shards


def cmd_heal(args: argparse.Namespace) -> int:
    shard = parse_shard(args.shard) if args.shard else None
    if args.workers < 1:
        raise InputError(f"--workers {args.workers}: expected a count of worker processes, at least 1")
    if args.workers > 1 and (shard is not None or args.executor == "ray"):
        raise InputError(f"--workers {args.workers}: its workers are shards of this heal; leave out "
                         + ("--shard" if shard is not None else "--executor ray"))
    if args.executor == "ray":
        from moeheal.pipeline.lake import scaleout

        if shard is not None:
            raise InputError("--executor ray: Ray schedules every unit; leave out --shard")
        scaleout.import_ray(local=args.ray_address is None)  # before any work: one line if it is not installed
    if args.workers > 1:
        from moeheal.pipeline.commands.workers import share_the_device

        share_the_device()  # before this process starts a device: it and the workers share it
    run = _pipeline(args)
    if shard is not None:
        units = run.shard_units(*shard)
        print(f"shard {shard[0]}/{shard[1]}: {len(units)} units in the lake; `moeheal heal` without --shard "
              "assembles, evaluates and publishes once every shard has finished")
        return 0
    from moeheal.pipeline.estimate import long_heal_note

    note = long_heal_note(_pipeline(args, plan=True))  # a heal past 10 minutes says so first
    if note:
        print(note, flush=True)
    if args.workers > 1:
        from moeheal.pipeline.commands.workers import run_shard_workers

        failed = [w.returncode for w in run_shard_workers(Path(args.config), args.workers) if w.returncode]
        if failed:  # each worker printed its own error; the line once
            return failed[0]
    if args.executor == "ray":
        scaleout.heal_units_on_ray(run, args.ray_address, args.gpus_per_unit)
    run.heal()
    print(run.summary_table())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.device and not args.estimate:
        raise InputError("--device: only with --estimate")
    if args.estimate:
        return plan_estimate(args)
    if args.units:
        return plan_units(_pipeline(args, plan=True), args.format)
    planned = _pipeline(args, plan=True).plan()
    if args.format == "json":
        print(json.dumps([vars(p) for p in planned], indent=1))
    elif args.format in ("dot", "mermaid"):
        from moeheal.pipeline.lake import dagdraw

        print(dagdraw.to_dot(planned) if args.format == "dot" else dagdraw.to_mermaid(planned))
    else:
        width = max(len(p.stage) for p in planned)
        for p in planned:
            print(f"{p.stage:<{width}}  {p.fingerprint}  {p.status}")
        todo = sum(p.status == "compute" for p in planned)
        skipped = sum(p.status == "skipped" for p in planned)
        print(f"{len(planned)} stage invocations: {len(planned) - todo - skipped} cached, {todo} to compute"
              + (f", {skipped} skipped (llama.cpp's stages: llama.cpp not installed, or no unseen trace)"
                 if skipped else ""))
    return 0


def plan_estimate(args: argparse.Namespace) -> int:
    """`plan --estimate`: the predicted wall time per stage kind of what a heal would compute (the plan's
    `compute` entries) on a device class, from the cost model fitted to the timing records; runs nothing."""
    from moeheal.pipeline import estimate

    device = args.device or estimate.default_device()
    constants = estimate.device_constants(estimate.load_cost_model(), device)  # a bad --device: before the plan
    predicted = estimate.seconds(estimate.plan_invocations(_pipeline(args, plan=True)), constants)
    print(json.dumps({"device": device, "seconds": predicted, "total_s": estimate.total_s(predicted)}, indent=1)
          if args.format == "json" else estimate.estimate_table(predicted, device))
    return 0


def plan_units(run, fmt: str) -> int:
    """`plan --units`: the per-layer units a heal executes (what `--shard I/N` splits, one Slurm array
    task or Ray task each), in order, each with its stages and whether they are in the lake."""
    status = {p.stage: p.status for p in run.plan()}
    units = []
    for i, node in enumerate(run.unit_nodes()):  # a sensitivity unit alone; a calibrate unit with its quantize
        name, layer = node.key
        stages = [node.label] if node.stage.name == "sensitivity" else [f"quantize:{name}:{layer}", node.label]
        units.append({"unit": i, "variant": name, "layer": layer, "stages": stages})
    for unit in units:
        unit["status"] = "cached" if all(status.get(s) == "cached" for s in unit["stages"]) else "compute"
    if fmt == "json":
        print(json.dumps(units, indent=1))
        return 0
    for unit in units:
        print(f"{unit['unit']:>4}  {' '.join(unit['stages'])}  {unit['status']}")
    todo = sum(u["status"] == "compute" for u in units)
    print(f"{len(units)} units: {len(units) - todo} cached, {todo} to compute")
    return 0


# What each command that stops short of evaluation publishes (the rest of the current set is carried
# forward where its inputs did not change: HealRun.publish).
AUDIT_TABLES = ("overlap", "docs", "cal_trace", "windows")
DUMP_TABLES = AUDIT_TABLES + ("routing",)
CALIBRATE_TABLES = DUMP_TABLES + ("sensitivity", "learned_curve", "layer_metrics", "ridge_cv", "variants", "recipe", "sizes")


def cmd_audit(args: argparse.Namespace) -> int:
    from moeheal.pipeline.heal import audit_summary

    run = _pipeline(args)
    print(audit_summary(run.overlap()))
    run.publish(only=AUDIT_TABLES)
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    run = _pipeline(args)
    for trace in run.traces_present():  # the unseen trace only when [calibration] unseen_tokens > 0
        result = run.result(run.dump(trace))
        print(f"{trace}: {result.path}")
    run.publish(only=DUMP_TABLES)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    run = _pipeline(args)
    for variant in run.all_quantized_variants():  # one unit per layer: `quantize:<variant>:<layer>`
        for layer in run.source.moe_layers:
            print(f"{variant.name}:{layer}: {run.result(run.quantize(variant, layer)).path}")
    run.publish(only=DUMP_TABLES + ("sensitivity", "learned_curve"))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    run = _pipeline(args)
    for variant in run.all_quantized_variants():
        print(f"{variant.name}: {run.result(run.assemble(variant)).path}")
    run.publish(only=CALIBRATE_TABLES)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    run = _pipeline(args)
    run.publish(with_report=False)
    print(run.summary_table())
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render the report of the published tables, published with them as a new set."""
    from moeheal.pipeline.publish.report import write_report

    lake = _pipeline(args).lake
    lake.republish({}, report=write_report)
    print(lake.report_dir)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    run = _pipeline(args)
    print(run.export(Path(args.out)))
    return 0


def cmd_imatrix(args: argparse.Namespace) -> int:
    run = _pipeline(args)  # the imatrix comes before the peers made with it
    print(run.write_imatrix(Path(args.out)))
    return 0


def cmd_recipe(args: argparse.Namespace) -> int:
    import shlex

    from moeheal.pipeline.commands.init import with_uniform_format
    from moeheal.pipeline.heal import HealRun

    cfg = _config(args)
    if args.quant:
        cfg = with_uniform_format(cfg, args.variant, args.quant)
    run = HealRun(cfg, log=lambda message: print(message, file=sys.stderr))  # before the peer it makes
    print(shlex.join(run.llama_quantize_command(args.variant, Path(args.imatrix), Path(args.out) if args.out else None,
                                                args.llama_quantize)))
    return 0


def cmd_import_dump(args: argparse.Namespace) -> int:
    run = _pipeline(args)
    print(run.result(run.import_dump(Path(args.spec).resolve())).path)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from moeheal.pipeline.commands.sql import run_user_sql
    from moeheal.pipeline.lake.store import Lake

    lake = Lake(_config(args).lake_root)
    fmt, *rest = args.format
    if fmt not in ("table", "csv", "parquet") or len(rest) > (fmt == "parquet"):
        raise InputError(f"sql: --format {' '.join(args.format)}: expected table, csv or parquet OUT")
    return run_user_sql(lake, args.query, fmt, rest[0] if rest else args.out)


def cmd_synth(args: argparse.Namespace) -> int:
    from moeheal.pipeline.sources.synth import parse_size, write_synth

    split_max_size = parse_size(args.split_max_size) if args.split_max_size else 0
    result = write_synth(Path(args.out), args.like, args.layers, args.seed, args.type, split_max_size,
                         args.vocab, args.experts, args.zeros, jobs=args.jobs)
    shards = f" in {len(result.paths)} shards" if len(result.paths) > 1 else ""
    print(f"{result.paths[0]}: {result.n_tensors} tensors, {result.n_bytes / 1e9:.2f} GB{shards}, "
          f"{result.seconds:.1f} s")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from moeheal.pipeline.commands.init import init_folder

    result = init_folder(Path(args.dir), Path(args.model), [Path(t) for t in args.text], args.seed, args.bits,
                         args.size)
    roles = ", ".join(f"{n} {role}" for role, n in result.roles.items())
    config = result.folder / "heal.toml"
    print(f"{result.folder}: {result.n_docs} documents ({roles}), {result.n_windows} windows, "
          f"calibration {result.cal_tokens} tokens")
    print(f"ladder: {', '.join(result.variants)}")
    if result.peers:
        print(f"llama.cpp found: `bash {result.folder / 'peers.sh'}` adds its files at the same sizes as peers "
              f"(optional): {', '.join(result.peers)}")
    print("next:")
    print(f"  moeheal heal -c {config}")
    print(f"  moeheal report -c {config}")
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "init": (cmd_init, "a folder with docs, a frozen split, windows and a heal.toml for your own model and text"),
    "heal": (cmd_heal, "run the whole DAG (every stage cached by fingerprint)"),
    "plan": (cmd_plan, "list every stage with its fingerprint and whether it is cached, running nothing"),
    "audit": (cmd_audit, "split and n-gram overlap checks only (exit 3 on a violation)"),
    "dump": (cmd_dump, "dump the reference model's MoE activations to Zarr"),
    "quantize": (cmd_quantize, "quantize the routed experts of every variant"),
    "calibrate": (cmd_calibrate, "alpha + ridge healing, write healed GGUFs"),
    "eval": (cmd_eval, "KLD and top-1 of every variant against the reference (publishes the tables)"),
    "report": (cmd_report, "write report.md and plots from the lake's tables"),
    "imatrix": (cmd_imatrix, "write the calibration statistics as a llama.cpp imatrix GGUF"),
    "recipe": (cmd_recipe, "print the llama-quantize command line that makes a variant's recipe with llama.cpp"),
    "import-dump": (cmd_import_dump, "import raw float32 dumps made by another engine"),
    "sql": (cmd_sql, "query the lake's views"),
    "export": (cmd_export, "reviewer bundle: tables as Parquet + report + plots"),
    "synth": (cmd_synth, "write a GGUF with a real model's shapes, types and metadata and random weights "
                         "(per role, the small demo model's spread and kurtosis)"),
}


def cmd_lake_du(args: argparse.Namespace) -> int:
    from moeheal.pipeline.lake import gc

    print(gc.du([Path(c) for c in args.config], args.keep_sets))
    return 0


def cmd_lake_gc(args: argparse.Namespace) -> int:
    from moeheal.pipeline.lake import gc

    print(gc.gc([Path(c) for c in args.config], args.keep_sets, args.yes,
                log=lambda message: print(message, file=sys.stderr)))
    return 0


def cmd_lake_repair(args: argparse.Namespace) -> int:
    from moeheal.pipeline.config import load_config
    from moeheal.pipeline.lake.store import Lake

    roots = {load_config(Path(c), peers_may_be_missing=True).lake_root for c in args.config}
    if len(roots) > 1:
        raise InputError(f"-c: the configs name {len(roots)} lakes ({', '.join(map(str, sorted(roots)))}); "
                         "`moeheal lake repair` repairs one")
    print(Lake(roots.pop(), check_current=False).repair())
    return 0


# `moeheal lake <command>`: what a lake holds and its upkeep, over every config that shares it.
LAKE_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "du": (cmd_lake_du, "per stage: outputs, bytes, how many the configs still read, and what gc would free"),
    "gc": (cmd_lake_gc, "remove the outputs no config reads and no kept published set names, and tmp/'s stale "
                        "entries (a dry run unless --yes)"),
    "repair": (cmd_lake_repair, "point `current` at the newest complete published set where the set it points at "
                                "is missing or incomplete, and say which"),
}


def _lake_parser(sub: argparse._SubParsersAction) -> None:
    lake = sub.add_parser("lake", help="what a lake holds, and its upkeep", description="what a lake holds, "
                          "and its upkeep: `moeheal lake COMMAND -h`")
    commands = lake.add_subparsers(dest="lake_command", required=True, metavar="LAKE_COMMAND")
    for name, (fn, help_text) in LAKE_COMMANDS.items():
        p = commands.add_parser(name, help=help_text, description=help_text)
        p.add_argument("-c", "--config", nargs="+", default=["heal.toml"], metavar="CFG",
                       help="every config whose outputs to keep (all of one lake)")
        p.set_defaults(fn=fn)
        if name in ("du", "gc"):
            p.add_argument("--keep-sets", type=int, default=1, metavar="N",
                           help="keep what the newest N published sets were computed from (default 1: the current)")
        if name == "gc":
            p.add_argument("--yes", action="store_true", help="remove (without it, only say what would go)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeheal", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"moeheal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name not in ("synth", "init"):  # the commands that read no config
            p.add_argument("-c", "--config", default="heal.toml", help="path to heal.toml")
        p.set_defaults(fn=fn)
        if name in ("export", "imatrix"):
            p.add_argument("--out", required=True, help="output folder (export) or GGUF file (imatrix)")
        if name == "heal":
            p.add_argument("--shard", metavar="I/N",
                           help="build only worker I's share of the per-layer quantize and calibrate units of N "
                                "workers on this lake (one per GPU or host), then stop; run without it afterwards")
            p.add_argument("--workers", type=int, default=1, metavar="N",
                           help="build the per-layer units on N `--shard I/N` processes at once on this machine "
                                "(its cores; on one GPU they share it, no faster at 2 layers of a 30B in the one "
                                "measurement, docs/real-sizes.md), then the rest here; the same bytes as one process")
            p.add_argument("--executor", choices=("local", "ray"), default="local",
                           help="ray: the per-layer units (and what they read) as Ray tasks in the DAG's order, "
                                "then the rest here (pip install 'moeheal[ray]'; docs/scale-out.md)")
            p.add_argument("--ray-address", help="an existing Ray cluster (default: a local one, ray.init())")
            p.add_argument("--gpus-per-unit", type=float,
                           help="GPUs Ray reserves per unit (default: 1 where the cluster has GPUs, else 0)")
        if name == "plan":
            p.add_argument("--format", choices=("table", "json", "dot", "mermaid"), default="table",
                           help="json: a list of {stage, fingerprint, status, upstream}; dot (Graphviz) or "
                                "mermaid: the DAG, one node per stage with its units' cache status")
            p.add_argument("--units", action="store_true",
                           help="list the per-layer units a heal executes (what --shard and a Slurm array split)")
            p.add_argument("--estimate", action="store_true",
                           help="the predicted wall time per stage kind and in total of what a heal would compute")
            p.add_argument("--device", metavar="h200|h100|cpu",
                           help="--estimate for this device class (default: what JAX sees)")
        if name == "recipe":
            p.add_argument("--variant", required=True, help="a [[variant]] name of the config")
            p.add_argument("--imatrix", default="imatrix.gguf",
                           help="importance matrix for llama-quantize (make it with `moeheal imatrix`); "
                                "left out for a variant without importance")
            p.add_argument("--out", help="the GGUF llama-quantize writes (default: VARIANT-llama.gguf)")
            p.add_argument("--llama-quantize", default="llama-quantize", help="the llama-quantize binary")
            p.add_argument("--quant", metavar="FORMAT",
                           help="every routed tensor in FORMAT instead of the variant's (one of fixed formats): "
                                "llama.cpp's uniform type with the variant's other settings")
        if name == "import-dump":
            p.add_argument("spec", help="TOML naming the raw files: trace, T, d, f, k, [[layers]]")
        if name == "sql":
            p.add_argument("query", help="a SELECT statement or a .sql file")
            p.add_argument("--format", nargs="+", default=["table"], metavar="FORMAT [OUT]",
                           help="table (default), csv, or parquet OUT")
            p.add_argument("--out", help="output file for --format parquet")
        if name == "synth":
            _synth_arguments(p)
        if name == "init":
            p.add_argument("dir", help="the folder to write (new, or empty)")
            p.add_argument("--model", required=True, help="a GGUF file, or a Hugging Face checkpoint folder "
                                                          "(safetensors + config.json), converted into DIR/model.gguf")
            p.add_argument("--text", action="append", default=[], metavar="PATH",
                           help="a text file, a folder of them (sub-folders name strata), JSONL with a `text` "
                                "field or Parquet with a `text` column (optional `stratum`); repeatable; "
                                "default: the small corpus shipped with moeheal")
            p.add_argument("--seed", type=int, default=0, help="seed of the split, the windows and the traces")
            p.add_argument("--bits", nargs="+", metavar="B",
                           help="a recipe per size, in bits per routed weight (default: 2.625, Q2_K's size, and 2.3)")
            p.add_argument("--size", help="also a recipe of the whole file within this size (11GiB, 10.5G, 500MB)")
    _lake_parser(sub)
    return parser


def _synth_arguments(p: argparse.ArgumentParser) -> None:
    """Names are checked by `write_synth` (one InputError line), so building the parser imports nothing."""
    p.add_argument("--like", required=True, metavar="NAME",
                   help="the model whose shapes to copy: qwen3-30b-a3b, qwen3-235b, mixtral-8x7b, or qwen3-next-80b "
                        "(qwen3next: keep at least 4 layers, so one is full attention)")
    p.add_argument("--layers", type=int, help="write the first N layers (default: all of the model's)")
    p.add_argument("--out", required=True, help="the GGUF to write (shards <stem>-0000i-of-0000n.gguf when split)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed and the tensor name")
    p.add_argument("--type", default="q8_0", help="type of the matrices: q8_0 (default), f16, bf16 or f32 "
                                                  "(norms, biases and routers stay f32)")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="split into llama.cpp gguf-split shards of at most SIZE of tensor data (500M, 50G)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="worker processes drawing the weights (default 1; the file does not depend on it)")
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)  # tests: a smaller vocabulary
    p.add_argument("--experts", type=int, help=argparse.SUPPRESS)  # tests: fewer routed experts
    p.add_argument("--zeros", action="store_true", help=argparse.SUPPRESS)  # tests: sparse zero weights


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prepare_compilation()  # before anything compiles: XLA reads its flags when the backend starts
    try:
        with contextlib.ExitStack() as args.held:  # what the command holds until it ends (`_pipeline`)
            return args.fn(args)
    except MoehealError as exc:
        print(f"moeheal: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a full disk or a read-only lake: the environment, not a bug
        if exc.errno not in WRITE_ERRNOS:
            raise
        print(f"moeheal: error: {exc.filename or 'the lake'}: cannot write ({exc.strerror}); "
              "nothing published changed", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moeheal: interrupted; finished stages are kept, unfinished ones resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
