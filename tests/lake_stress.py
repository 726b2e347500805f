"""One lake under everything at once, with SIGKILLs at random moments: the publishing stress test.

Real processes on one small lake (tests/test_publish.py runs it; run by hand for the figures in
bench/RESULTS.md, *Reliability: publishing under kills*):

    JAX_PLATFORMS=cpu MOEHEAL_PLOTS=0 .venv/bin/python -P tests/lake_stress.py --rounds 200

- three publishers, one per variant, each publishing its variant's table in a loop, in turn as a
  heal does (`Lake.publish` of a staged set under the run lock, the other variants carried from
  the current set) and as `moeheal report` does (`Lake.republish`);
- `moeheal sql` and `moeheal report`, the real command line, one of each at any time, restarted
  when they end;
- a notebook: `cd lake`, `duckdb.connect("current/lake.duckdb")` read-write, a table written into
  it (what moves an older set's modification time), every view read, closed, again.

Every set is self-describing: its `stamp` table names its own token and the token of each variant
table it holds, so a reader that mixed two sets, or missed a table, is seen. Each round lets them
run for a moment, SIGKILLs one of them (most rounds), then freezes them all (SIGSTOP) and checks
the lake as it is: `current` resolves, to a complete, self-consistent set; every set in
`published/` is complete; `current` is never older than a publication that has returned; and a
publication that returned is still in `published/` unless KEEP_GENERATIONS newer sets were
published after it. The readers' outputs are checked as they come: each must be one whole set.
`moeheal heal` itself is not run (minutes per heal on two cores): the publishers call the same
`Lake` methods its last step does.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("a", "b", "c")
SQL = ("SELECT s.token, s.a, s.b, s.c, va.token AS ta, vb.token AS tb, vc.token AS tc "
       "FROM stamp s, variant_a va, variant_b vb, variant_c vc")
KILL_WEIGHT = {"publisher": 1.0, "notebook": 1.0, "sql": 0.3, "report": 0.3}  # the commands mostly finish


# ---- the workers (each its own process: `python tests/lake_stress.py worker ROLE ...`) --------------
def _log(log: Path, **record) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")


def _stamp(tables, token: str):
    """The `stamp` table of a set holding `tables` (a TableSet): its own token, each variant's."""
    import pyarrow as pa

    row = {"token": [token]}
    for v in VARIANTS:
        row[v] = [tables.read_table(f"variant_{v}").column("token")[0].as_py()]
    return pa.table(row)


def publish_once(root: Path, variant: str, log: Path, n: int) -> None:
    """One publication of `variant`'s table: as a heal's last step for even `n`, else as `moeheal report`."""
    import pyarrow as pa

    from moeheal.pipeline.lake.store import Lake, read_generation

    lake = Lake(root)
    token = f"{variant}{os.getppid()}.{n}"
    mine = pa.table({"token": [token]})
    _log(log, event="staging", token=token)  # before anything: a reader may see it from here on
    if n % 2 == 0:  # a heal's last step: stage under the run lock, carry the rest, publish
        with lake.lock("run"):
            final = None
            while final is None:
                publication = lake.begin_publication()
                try:
                    base = lake.current_folder()  # resolved once: the carried tables are one set's
                    for v in VARIANTS:
                        if v != variant:
                            publication.carry(f"variant_{v}", base / "tables" / f"variant_{v}.parquet", None)
                    publication.write_table(f"variant_{variant}", mine)
                    publication.write_table("stamp", _stamp(publication, token))
                    publication.report_dir.mkdir(parents=True, exist_ok=True)
                    (publication.report_dir / "report.md").write_text(f"stamp {token}\n")
                    final = lake.publish(publication)
                except FileNotFoundError:  # the base set was pruned while carrying (two publications
                    publication.discard()  # by the others meanwhile): stage again from the new one
                    _log(log, event="restaged", token=token)
                except BaseException:
                    publication.discard()
                    raise
    else:  # `moeheal report`'s and `Lake.write_table`'s path: the current set with a table replaced
        def report(tables, folder: Path, token=token) -> None:
            tables.write_table("stamp", _stamp(tables, token))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "report.md").write_text(f"stamp {token}\n")

        final = lake.republish({f"variant_{variant}": mine}, report=report)
    record = read_generation(final) or {}
    _log(log, event="published", token=token, folder=final.name, seq=record.get("seq"),
         previous=record.get("previous"))


def notebook_once(root: Path, log: Path) -> None:
    """A notebook's session: opened read-write, written into, every view read, closed."""
    import duckdb

    os.chdir(root)  # as docs/notebook.md and the views' relative paths want it
    con = duckdb.connect("current/lake.duckdb")  # read-write, as a notebook opens it
    try:
        wrote = True
        try:
            con.execute("CREATE TABLE IF NOT EXISTS scratch (x INTEGER)")
            con.execute("INSERT INTO scratch VALUES (1)")
        except duckdb.Error as exc:  # its set was pruned meanwhile: the file's folder is gone
            wrote = str(exc).splitlines()[0]
        seen = {"stamp": [list(r) for r in con.execute("SELECT token, a, b, c FROM stamp").fetchall()]}
        for v in VARIANTS:
            seen[v] = [r[0] for r in con.execute(f"SELECT token FROM variant_{v}").fetchall()]
    finally:
        try:
            con.close()
        except duckdb.Error:
            pass
    _log(log, event="read", wrote=wrote, seen=seen)


def worker(argv: list[str]) -> None:
    """A worker's parent: it imports once, then forks a child for each operation and waits for it, so a
    SIGKILL (the driver kills the child) costs no restart. A child that fails ends the worker."""
    import traceback

    import duckdb  # noqa: F401  (imported before forking: the children start at once)
    import pyarrow  # noqa: F401

    import moeheal.pipeline.lake.store  # noqa: F401

    role, root, log = argv[0], Path(argv[1]), Path(argv[2])
    rng = random.Random(os.getpid())
    for n in range(1_000_000):
        child = os.fork()
        if child == 0:
            code = 0
            try:
                if role == "publisher":
                    publish_once(root, argv[3], log, n)
                else:
                    notebook_once(root, log)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(child, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
            raise SystemExit(f"{role}: child {child} failed")
        time.sleep(rng.uniform(0.05, 0.4) if role == "publisher" else rng.uniform(0.0, 0.3))


# ---- the driver ------------------------------------------------------------------------------------
@dataclass
class Summary:
    rounds: int = 0
    kills: dict[str, int] = field(default_factory=dict)
    publications: int = 0  # returned (killed ones not counted)
    sets_checked: int = 0  # a set in published/ found complete at a check (summed over checks)
    distinct_sets: int = 0
    sql_reads: int = 0
    reports: int = 0
    notebook_reads: int = 0
    notebook_writes_refused: int = 0  # its set pruned while it held the file: the write fails, reads do not
    restaged: int = 0  # a heal-like publisher's base set pruned while it carried from it: staged again
    sets_lost: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        kills = ", ".join(f"{k} {n}" for k, n in sorted(self.kills.items()))
        return (f"{self.rounds} rounds, {sum(self.kills.values())} kills ({kills}), {self.publications} "
                f"publications returned, {self.sets_checked} sets checked ({self.distinct_sets} distinct), "
                f"{self.sql_reads} moeheal sql, {self.reports} moeheal report, {self.notebook_reads} notebook "
                f"reads ({self.notebook_writes_refused} writes refused: set pruned), sets lost {self.sets_lost}, "
                f"violations {len(self.violations)}, {self.seconds:.0f} s")


def write_config(folder: Path, model: Path) -> Path:
    """A heal.toml whose lake is `folder/lake` (for `moeheal sql` and `report`; nothing is healed)."""
    sys.path.append(str(REPO))
    from bench.inputs.healworld import write_world

    return write_world(folder, model=model, variants='[[variant]]\nname = "v1"\nquant = "q8_0"\n')


def seed_lake(root: Path) -> None:
    import pyarrow as pa

    from moeheal.pipeline.lake.store import Lake

    def report(tables, folder: Path) -> None:
        tables.write_table("stamp", _stamp(tables, "seed"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.md").write_text("stamp seed\n")

    Lake(root).republish({f"variant_{v}": pa.table({"token": [f"{v}seed"]}) for v in VARIANTS}, report=report)


class Driver:
    def __init__(self, config: Path, logs: Path, seed: int, say=print):
        self.config, self.logs, self.say = config, logs, say
        self.root = config.parent / "lake"
        self.rng = random.Random(seed)
        self.procs: dict[str, subprocess.Popen] = {}
        self.kinds: dict[str, str] = {}
        self.outputs: dict[str, Path] = {}
        self.summary = Summary()
        self.published: dict[str, dict] = {}  # folder name -> the publisher's record, once returned
        self.content: dict[str, tuple] = {}  # set token -> (a, b, c): what every reader of it must see
        self.linked: dict[str, int] = {}  # folder -> seq, of every set known to have been current
        self.last_current_seq = 0
        self.seen_sets: set[str] = set()
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOEHEAL_PLOTS": "0"}
        self.env.pop("MOEHEAL_KILL_AT", None)
        self.log_offsets: dict[Path, int] = {}
        self.started = 0
        self.wait_for_commands = False

    # processes
    def start(self, name: str) -> None:
        kind = name.rstrip("abc") if name.startswith("publisher") else name
        self.started += 1
        out = self.logs / f"{name}.{self.started}.out"
        self.outputs[name] = out
        if kind in ("sql", "report"):
            cmd = [sys.executable, "-P", "-m", "moeheal", kind, "-c", str(self.config)]
            cmd += [SQL, "--format", "csv"] if kind == "sql" else []
        else:
            log = self.logs / f"{name}.jsonl"
            cmd = [sys.executable, "-P", __file__, "worker", kind, str(self.root), str(log)]
            cmd += [name[-1]] if kind == "publisher" else []
        with open(out, "w") as handle:  # each in its own process group: frozen and thawed whole
            self.procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True)
        self.kinds[name] = kind

    def group(self, proc: subprocess.Popen) -> list[int]:
        """The process and its children (a worker's child doing the operation)."""
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        return [proc.pid, *map(int, children)]

    def kill_one(self) -> None:
        """SIGKILL one process doing something: a worker's child mid-operation, or a command."""
        victims = []
        for name, proc in self.procs.items():
            kind = self.kinds[name]
            if kind in ("sql", "report"):
                if not self.wait_for_commands:
                    victims.append((name, proc.pid, KILL_WEIGHT[kind]))
            else:
                victims += [(name, pid, KILL_WEIGHT[kind]) for pid in self.group(proc)[1:]]
        if not victims:
            return
        name, pid, _ = self.rng.choices(victims, [w for _, _, w in victims])[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.summary.kills[self.kinds[name]] = self.summary.kills.get(self.kinds[name], 0) + 1
        if self.kinds[name] in ("sql", "report"):
            self.reap(name, killed=True)

    def reap(self, name: str, killed: bool) -> None:
        """A process that ended: the commands' output checked (unless killed); any other end is a failure."""
        proc, kind = self.procs.pop(name), self.kinds[name]
        code = proc.wait()
        text = self.outputs[name].read_text(errors="replace")
        if killed:
            return
        if code != 0:
            self.violate(f"{name} exited {code}: {text.strip().splitlines()[-1:] if text.strip() else ''}")
        elif kind == "sql":
            rows = list(csv.DictReader(io.StringIO(text)))
            if len(rows) != 1:
                self.violate(f"moeheal sql printed {len(rows)} rows: {text[:200]!r}")
            else:
                self.check_seen("moeheal sql", rows[0]["token"], (rows[0]["a"], rows[0]["b"], rows[0]["c"]),
                                (rows[0]["ta"], rows[0]["tb"], rows[0]["tc"]))
                self.summary.sql_reads += 1
        elif kind == "report":
            self.summary.reports += 1
        else:
            self.violate(f"{name} ended by itself: {text[-300:]!r}")

    def violate(self, what: str) -> None:
        self.summary.violations.append(what)
        self.say(f"VIOLATION: {what}")

    def freeze(self, sig: int) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGSTOP:  # wait until each is stopped (or gone)
            deadline = time.monotonic() + 5
            for pid in (pid for proc in self.procs.values() for pid in self.group(proc)):
                while time.monotonic() < deadline:
                    try:
                        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    except OSError:
                        break
                    if state in ("T", "t", "Z", "X"):
                        break
                    time.sleep(0.001)

    # what the logs say
    def read_logs(self) -> None:
        for log in sorted(self.logs.glob("*.jsonl")):
            with open(log) as f:
                f.seek(self.log_offsets.get(log, 0))
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]  # a killed writer's last line may be cut
            self.log_offsets[log] = self.log_offsets.get(log, 0) + len(complete.encode())
            for line in complete.splitlines():
                record = json.loads(line)
                if record["event"] == "published":
                    self.published[record["folder"]] = record
                    self.summary.publications += 1
                    if record.get("seq") is not None:
                        self.linked[record["folder"]] = record["seq"]
                elif record["event"] == "read":
                    seen = record["seen"]
                    if len(seen["stamp"]) != 1 or any(len(seen[v]) != 1 for v in VARIANTS):
                        self.violate(f"notebook read a table with other than one row: {seen}")
                        continue
                    token, *stamped = seen["stamp"][0]
                    if token in self.content and self.content[token] != tuple(stamped):
                        self.violate(f"notebook read stamp {token} as {stamped}, published as {self.content[token]}")
                    if tuple(seen[v][0] for v in VARIANTS) != tuple(stamped):  # the views read the set opened
                        self.violate(f"notebook read tables {[seen[v][0] for v in VARIANTS]} of two sets: "
                                     f"its stamp names {stamped}")
                    self.pending.append((f"notebook ({log.name})", token))
                    self.summary.notebook_reads += 1
                    self.summary.notebook_writes_refused += record["wrote"] is not True
                elif record["event"] == "staging":
                    self.staged.add(record["token"])
                elif record["event"] == "restaged":
                    self.summary.restaged += 1

    def check_seen(self, who: str, token: str, stamped: tuple, seen: tuple) -> None:
        if tuple(seen) != tuple(stamped):
            self.violate(f"{who} saw set {token} mixed or incomplete: stamp {stamped}, tables {seen}")
        if token in self.content and self.content[token] != tuple(stamped):
            self.violate(f"{who} saw set {token} as {stamped}, published as {self.content[token]}")

    # the lake, frozen
    def check_lake(self) -> None:
        import pyarrow.parquet as pq

        from moeheal.pipeline.lake.store import KEEP_GENERATIONS, read_generation, set_folders, set_problem

        link = self.root / "current"
        if not link.is_symlink() or not link.resolve().is_dir():
            self.violate(f"current dangles: {os.readlink(link) if link.is_symlink() else 'no link'}")
            return
        current = link.resolve()
        sets = {}
        for folder in set_folders(self.root):
            problem = set_problem(folder)
            if problem is not None:
                self.violate(f"published/{folder.name} incomplete: {problem}")
                continue
            stamp = pq.read_table(folder / "tables" / "stamp.parquet").to_pylist()[0]
            tables = tuple(pq.read_table(folder / "tables" / f"variant_{v}.parquet").column("token")[0].as_py()
                           for v in VARIANTS)
            self.check_seen(f"published/{folder.name}", stamp["token"], tuple(stamp[v] for v in VARIANTS), tables)
            self.content.setdefault(stamp["token"], tables)
            sets[folder.name] = read_generation(folder)
            self.summary.sets_checked += 1
            self.seen_sets.add(folder.name)
        record = sets.get(current.name)
        if record is None:
            self.violate(f"current -> {current.name}: not a complete sequenced set")
            return
        self.linked[current.name] = record["seq"]
        for r in sets.values():  # a set's `previous` was current when it was published
            if r.get("previous") in sets:
                self.linked[r["previous"]] = sets[r["previous"]]["seq"]
        if record["seq"] < self.last_current_seq:
            self.violate(f"current went back: generation {record['seq']} after {self.last_current_seq}")
        self.last_current_seq = max(self.last_current_seq, record["seq"])
        newest_returned = max((p["seq"] for p in self.published.values() if p.get("seq")), default=0)
        if record["seq"] < newest_returned:
            self.violate(f"current is generation {record['seq']}, a publication that returned is {newest_returned}")
        for name, p in self.published.items():
            if name in sets or not p.get("seq"):
                continue
            newer = {n for n, seq in self.linked.items() if seq > p["seq"]}
            if len(newer) < KEEP_GENERATIONS:
                self.summary.sets_lost += 1
                self.violate(f"published/{name} (generation {p['seq']}) gone with {len(newer)} newer sets published")
                p["seq"] = None  # counted once

    def run(self, rounds: int, wait_for_commands: bool = False) -> Summary:
        """`rounds` rounds; with `wait_for_commands`, `moeheal sql` and `report` are never killed."""
        start = time.monotonic()
        self.wait_for_commands = wait_for_commands
        self.pending: list[tuple[str, str]] = []
        self.staged: set[str] = set()
        names = [f"publisher{v}" for v in VARIANTS] + ["notebook", "sql", "report"]
        for name in names:
            self.start(name)
        for n in range(rounds):
            time.sleep(self.rng.uniform(0.2, 0.8))
            for name in names:  # what ended by itself: the commands, or a worker whose child failed
                if name in self.procs and self.procs[name].poll() is not None:
                    self.reap(name, killed=False)
            if self.rng.random() < 0.8:
                self.kill_one()
            self.freeze(signal.SIGSTOP)
            try:
                self.read_logs()
                self.check_lake()
            finally:
                self.freeze(signal.SIGCONT)
            for name in names:
                if name not in self.procs:
                    self.start(name)
            self.summary.rounds += 1
        for name in ("sql", "report"):  # the commands running at the end finish, the publishers going on
            if name in self.procs:
                self.procs[name].wait(timeout=600)
                self.reap(name, killed=False)
        for name in list(self.procs):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
            self.reap(name, killed=True)
        self.read_logs()
        self.check_lake()
        for who, token in self.pending:  # every table a notebook read was one a publisher staged
            if token not in self.staged and not token.endswith("seed") and token != "seed":
                self.violate(f"{who} read {token}, which no publisher staged")
        self.summary.distinct_sets = len(self.seen_sets)
        self.summary.seconds = time.monotonic() - start
        return self.summary


def run(folder: Path, model: Path, rounds: int, seed: int = 0, wait_for_commands: bool = False,
        say=print) -> Summary:
    """The stress test in `folder` (a fresh folder) with a reference model for the config."""
    config = write_config(folder / "world", model)
    seed_lake(config.parent / "lake")
    logs = folder / "logs"
    logs.mkdir()
    return Driver(config, logs, seed, say).run(rounds, wait_for_commands)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, help="work folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    import tempfile

    folder = args.dir or Path(tempfile.mkdtemp(prefix="lake-stress-"))
    folder.mkdir(parents=True, exist_ok=True)
    sys.path.append(str(REPO))
    from bench.inputs.ggufs import make_tiny_gguf

    model = make_tiny_gguf(folder / "tiny.gguf", arch="qwen2moe", seed=0)
    summary = run(folder, model, args.rounds, args.seed)
    print(summary.line())
    return 1 if summary.violations else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
    else:
        sys.exit(main())
