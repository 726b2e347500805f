"""Ablation: what storing the calibration dumps in bfloat16 changes in the healed models.

Heals the demo's two GPTQ-healed variants from float32 dumps
(`dump-dtype-float32.toml`), copies their GGUFs into the bfloat16 ablation's
lake, then runs `dump-dtype.toml`: the same knobs healed from bfloat16 dumps,
evaluated beside the float32 ones on the same windows, with window-bootstrap
CIs on each pair's KLD difference. Afterwards `make card
CONFIG=demo/ablations/dump-dtype.toml` renders demo/README.md's blocks.

    .venv/bin/python demo/ablations/dump_dtype.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

from moeheal.pipeline.config import load_config
from moeheal.pipeline.heal import HealRun

HERE = Path(__file__).resolve().parent


def main() -> None:
    float32 = HealRun(load_config(HERE / "dump-dtype-float32.toml"))
    float32.audit()  # the split and overlap checks every heal runs first
    ablation = load_config(HERE / "dump-dtype.toml", peers_may_be_missing=True)
    outside = {v.name.removesuffix("_f32"): v.gguf for v in ablation.variants
               if v.gguf is not None}
    for variant in float32.cfg.variants:
        target = outside[variant.name]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(float32.assemble(variant).path, target)
    HealRun(load_config(HERE / "dump-dtype.toml")).heal()


if __name__ == "__main__":
    main()
