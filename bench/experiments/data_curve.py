"""Eval KLD against calibration tokens: each method's curve, from a healed lake of
`demo/ablations/data-curve.toml` (one 131,072-token dump, each variant from its first `cal_tokens`).

For every variant named `<method>_<n>k[_<knob>]` (ours: `q2_k_gptq_8k` ... `q2_k_learned_e2e_128k`; a
knob's name after the size, `q2_k_learned_e2e_64k_40steps`, is a lever's ablation at that size) and every
outside file of the config (AutoRound's and llama.cpp's at 8k and 64k, their amounts written here
in `PEERS`), per evaluation set (eval, canary) and subset (all windows, clean windows): the
pooled KLD (scored tokens' KL summed over windows / their tokens, moce bonus 0, the published
`window_kld`), its ratio to AutoRound's at its default 65,536 tokens with a paired window
bootstrap (`llama_kld.bootstrap_ratio`, scipy's, over windows with replacement, not within strata
as the `comparisons` table resamples: that table's intervals for the config's own pairs are the
ones to quote; the config's `[eval] bootstrap` replicates and seed), and the seconds the variant's
own units took (its quantize, calibrate, healed-dump and e2e stages, from the lake's provenance
records: what more data costs). Writes `curve.csv`, `curve.md` and `curve.png` (eval KLD against
tokens, log scale) to `--out`, and the table between demo/README.md's `<!-- data-curve:table -->`
markers.

    .venv/bin/python bench/experiments/data_curve.py [-c demo/ablations/data-curve.toml] [--out bench/results/data-curve]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from moeheal.pipeline.config import load_config
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.llamacpp import bootstrap_ratio

REPO = Path(__file__).resolve().parents[2]
DEMO_README = REPO / "demo" / "README.md"
TABLE_MARKERS = ("<!-- data-curve:table -->", "<!-- /data-curve:table -->")
# The outside files' calibration tokens (demo/peers/README.md): AutoRound and llama.cpp's imatrix
PEERS = {"q2_k_autoround": ("autoround", 8192), "q2_k_autoround_65k": ("autoround", 65536),
         "q2_k_imatrix": ("llama.cpp imatrix", 8192), "q2_k_imatrix_65k": ("llama.cpp imatrix", 65536)}
BASELINE = "q2_k_autoround_65k"  # AutoRound at its default data
OURS = re.compile(r"^(?P<method>.+?)_(?P<k>\d+)k(?:_(?P<knob>.+))?$")
OWN_STAGES = ("quantize", "calibrate", "healed-dump", "e2e")  # a variant's own units (not the shared dumps)


def method_and_tokens(name: str, dump_tokens: int, cal_tokens: int) -> tuple[str, int]:
    """(method, calibration tokens) of a variant: a peer's from `PEERS`, ours from its `cal_tokens`."""
    if name in PEERS:
        return PEERS[name]
    match = OURS.match(name)
    method = match.group("method").removeprefix("q2_k_")
    return (f"{method}, {match.group('knob')}" if match.group("knob") else method), cal_tokens or dump_tokens


def pooled(window_kld: dict[str, np.ndarray], tokens: np.ndarray, rows: np.ndarray) -> float:
    return float(window_kld[rows].sum() / tokens[rows].sum())


def unit_seconds(run: HealRun, lake_root: Path) -> dict[str, float]:
    """Seconds each variant's own units took, from `runs/<fingerprint>.json` of the planned nodes."""
    seconds: dict[str, float] = defaultdict(float)
    for planned in run.plan():
        parts = planned.stage.split(":")
        if parts[0] in OWN_STAGES and len(parts) >= 2:
            record = lake_root / "runs" / f"{planned.fingerprint}.json"
            if record.exists():
                r = json.loads(record.read_text(encoding="utf-8"))
                seconds[parts[1]] += r["finished"] - r["started"]
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=REPO / "demo/ablations/data-curve.toml")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/data-curve")
    args = parser.parse_args()
    cfg = load_config(args.config)
    lake = Lake(cfg.lake_root)
    wk = lake.read_table("window_kld").to_pylist()
    clean = {r["window_id"]: r["clean"] for r in lake.read_table("overlap").to_pylist()}
    cal = {v.name: v.cal_tokens for v in cfg.variants if v.kind != "external"}
    seconds = unit_seconds(HealRun(cfg, log=lambda _: None, plan=True), cfg.lake_root)
    windows = sorted({(r["set"], r["window_id"]) for r in wk})
    index = {w: i for i, w in enumerate(windows)}
    kld = defaultdict(lambda: np.zeros(len(windows)))
    tokens = np.zeros(len(windows))
    for r in wk:
        if r["moce_bonus"] == 0.0:
            i = index[(r["set"], r["window_id"])]
            kld[r["variant"]][i] = r["kld_sum"]
            tokens[i] = r["n_tokens"]
    rows = []
    names = [v.name for v in cfg.variants]
    for set_name in ("eval", "canary"):
        for subset in ("all", "clean"):
            sel = np.array([s == set_name and (subset == "all" or clean[w]) for s, w in windows])
            base = kld[BASELINE][sel]
            for name in names:
                method, n = method_and_tokens(name, cfg.cal_tokens, cal.get(name, 0))
                value = pooled(kld[name], tokens, sel)
                _, lo, hi = bootstrap_ratio(kld[name][sel], base, np.random.default_rng(cfg.eval_seed), cfg.bootstrap)
                rows.append({"set": set_name, "subset": subset, "variant": name, "method": method, "cal_tokens": n,
                             "windows": int(sel.sum()), "kld": value, "vs_autoround_65k": value / pooled(kld[BASELINE], tokens, sel),
                             "ci_lo": lo, "ci_hi": hi, "unit_seconds": round(seconds.get(name, 0.0), 1)})
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "curve.csv").open("w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        out.writeheader()
        out.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    lines = ["| method | calibration tokens | eval KLD | vs AutoRound at 64k [95% CI] | canary KLD | vs AutoRound at 64k "
             "[95% CI] | eval, clean windows: vs AutoRound at 64k | wall s of its own units |",
             "|---|---:|---:|---|---:|---|---|---:|"]
    get = {(r["set"], r["subset"], r["variant"]): r for r in rows}
    for name in sorted(names, key=lambda v: (method_and_tokens(v, cfg.cal_tokens, cal.get(v, 0)))):
        e, c, ec = (get[(s, sub, name)] for s, sub in (("eval", "all"), ("canary", "all"), ("eval", "clean")))
        lines.append(f"| {e['method']} | {e['cal_tokens']:,} | {e['kld']:.4f} | {e['vs_autoround_65k']:.3f} "
                     f"[{e['ci_lo']:.3f}, {e['ci_hi']:.3f}] | {c['kld']:.4f} | {c['vs_autoround_65k']:.3f} "
                     f"[{c['ci_lo']:.3f}, {c['ci_hi']:.3f}] | {ec['vs_autoround_65k']:.3f} [{ec['ci_lo']:.3f}, "
                     f"{ec['ci_hi']:.3f}] | {e['unit_seconds'] or '-'} |")
    table = "\n".join(lines) + "\n"
    (args.out / "curve.md").write_text(table, encoding="utf-8")
    print(table, end="")
    text = DEMO_README.read_text(encoding="utf-8")
    head, rest = text.split(TABLE_MARKERS[0], 1)
    _, tail = rest.split(TABLE_MARKERS[1], 1)
    DEMO_README.write_text(f"{head}{TABLE_MARKERS[0]}\n{table}{TABLE_MARKERS[1]}{tail}", encoding="utf-8")
    plot(rows, args.out / "curve.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Eval KLD (all windows) against calibration tokens, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    by_method: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r["set"] == "eval" and r["subset"] == "all":
            by_method[r["method"]].append((r["cal_tokens"], r["kld"]))
    for method, points in sorted(by_method.items()):
        if len(points) < 2:  # a lever's ablation at one size: in the table, not a curve
            continue
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration tokens")
    ax.set_ylabel("pooled KLD, eval windows")
    ax.set_title("Q2_K experts: KLD against calibration data (demo)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
