"""A small, complete heal.toml world for end-to-end tests and the fuzz report: model, corpus, split, windows.

The model is random but 256 wide, so every matrix row is a whole number of
TQ2_0 blocks; the corpus has four strata of random-word documents (no
16-gram is shared between documents by construction of their random draws).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from bench.inputs.ggufs import _WORDS as WORDS
from bench.inputs.ggufs import make_tiny_gguf

STRATA = ("ops", "chat_json", "ja", "persona")
ROLES = ["cal"] * 5 + ["eval"] * 3 + ["canary"] + ["unused"] * 3


def write_world(root: Path, model: Path | None = None, variants: str | None = None,
                moce_bonus: tuple[float, ...] = (0.0, 0.5)) -> Path:
    """Write model (unless given), docs, split, windows and heal.toml under `root`; return the config."""
    root.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = make_tiny_gguf(root / "ref.gguf", arch="qwen2moe", seed=3, n_layer=2, d_model=256, n_expert=8,
                               k=2, matrix_type="q8_0", d_expert=256, d_shexp=256)
    rng = random.Random(7)
    docs, split = [], []
    for s_index, stratum in enumerate(STRATA):
        for i, role in enumerate(ROLES):
            lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + f" {rng.randint(0, 999)}."
                     for _ in range(30)]
            doc_id = f"{stratum}_{i:02d}"
            docs.append({"doc_id": doc_id, "stratum": stratum, "text": "\n".join(lines)})
            split.append((doc_id, role))
    (root / "docs.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    with open(root / "split.csv", "w", newline="") as f:
        csv.writer(f).writerows([("doc_id", "role"), *split])
    with open(root / "windows.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["window_id", "doc_id", "stratum", "set", "ctx_tokens", "scored_tokens", "start"])
        for stratum in STRATA:
            for i, role in enumerate(ROLES):
                if role in ("eval", "canary"):
                    writer.writerow([f"{stratum}_w{i}", f"{stratum}_{i:02d}", stratum, role, 48, 32, 4])
    variants = variants if variants is not None else VARIANTS
    config = root / "heal.toml"
    config.write_text(f"""
[lake]
root = "lake"
[model]
reference = "{Path(model).name if Path(model).parent == root else Path(model).resolve()}"
[corpus]
docs = "docs.jsonl"
split = "split.csv"
[calibration]
tokens = 1024
seq_tokens = 256
unseen_tokens = 512
seed = 0
[eval]
windows = "windows.csv"
ngram = 16
bootstrap = 200
seed = 0
{variants}
[moce]
bonus = [{", ".join(str(b) for b in moce_bonus)}]
cache_experts = 4
""")
    return config


# v1 alone: the cheapest healed variant, for tests where what is healed does not matter
V1 = """
[[variant]]
name = "v1"
beta_gate_up = 0.5
beta_down = 0.5
ridge_rho = 6.0
round = "ls"
"""
VARIANTS = V1 + """[[variant]]
name = "v2"
round = "gptq"
gptq_damp = 1.0
gptq_shrink = 64
"""
