"""A rejected config leaves the demo's published lake byte for byte as it was.

    python demo/check_rejected_config.py            # after `make heal`

Copies the demo config next to a split that puts one calibration document
under a second role (a leak: the audit refuses it with exit 3), points it at
the demo's own lake, runs `moeheal heal` on it, and compares the SHA-256 of
every published file (tables, lake.duckdb, report and plots) before and after.
Exits 1 if anything changed or the run was not refused.
"""

from __future__ import annotations

import csv
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from moeheal.pipeline.config import load_config

DEMO = Path(__file__).resolve().parent


def published(lake: Path) -> dict[str, str]:
    """SHA-256 of every file a user reads, through the lake's links."""
    files = sorted(p for name in ("tables", "report") for p in (lake / name).resolve().rglob("*") if p.is_file())
    files.append((lake / "lake.duckdb").resolve())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def main() -> int:
    config = load_config(DEMO / "heal.toml")
    before = published(config.lake_root)
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(csv.reader(config.split.read_text(encoding="utf-8").splitlines()))
        leaked = next(doc for doc, role in rows[1:] if role == "cal")
        with open(Path(tmp) / "split.csv", "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([*rows, [leaked, "eval"]])
        text = (DEMO / "heal.toml").read_text(encoding="utf-8")
        for key, path in (("reference", config.reference), ("docs", config.docs), ("windows", config.windows)):
            text = text.replace(f'{key} = "{path.relative_to(DEMO)}"', f'{key} = "{path}"')
        text = text.replace('root = "../lake"', f'root = "{config.lake_root}"')
        text = text.replace('split = "split.csv"', f'split = "{Path(tmp) / "split.csv"}"')
        text = text.replace('gguf = "peers/', f'gguf = "{DEMO / "peers"}/')
        (Path(tmp) / "heal.toml").write_text(text, encoding="utf-8")
        run = subprocess.run([sys.executable, "-m", "moeheal", "heal", "-c", str(Path(tmp) / "heal.toml")],
                             capture_output=True, text=True)
    after = published(config.lake_root)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    print(f"doc {leaked} under cal and eval: moeheal heal exited {run.returncode}: {run.stderr.strip()[:160]}")
    print(f"published files: {len(before)} before, {len(after)} after, changed: {len(changed)}"
          + (f" ({', '.join(changed)})" if changed else ""))
    return 0 if run.returncode == 3 and not changed else 1


if __name__ == "__main__":
    sys.exit(main())
