"""What `moeheal init` writes, healed end to end on a converter file of each family: the ladder's smallest
recipe (allocation, learned rounding, e2e: every lever init sets). Test-sized knobs (and two candidate
formats) are applied to the written config by `shrink`, never to init's defaults. Not `compile_bound`: the
heal's rounding kernels run longer unoptimised than they save in compiling (qwen3moe: 55 s against 49 s,
77 against 69 CPU s, alone with a cold JAX cache).

All six are marked slow (`make test-slow`): each heal compiles the whole pipeline for its shapes, a
minute or more of a CI worker, and the suite must stay under 20 minutes on 2 cores. `make test` still
heals the family unlike the demo's qwen2moe that the 30B is (qwen3moe), with this file's checks, from
the installed wheel (tests/test_wheel_init.py: one heal for both); deepseek2's own heal, latent
attention and its dense first layer, is tests/test_arch_deepseek2.py's.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.test_init import FAMILIES, family_gguf, shrink, write_text_folder
from tests.test_init_heal import run

pytestmark = [pytest.mark.long, pytest.mark.slow]  # heals: left out of test-fast and of CI


@pytest.mark.parametrize("family", FAMILIES)
def test_the_smallest_recipe_heals_on_every_family(family, tmp_path, capsys):
    model = family_gguf(family, tmp_path / f"{family}.gguf")
    texts = write_text_folder(tmp_path / "texts", {"prose": 7, "notes": 6})
    folder = tmp_path / "mine"
    run(capsys, "init", str(folder), "--model", str(model), "--text", str(texts))
    shrink(folder / "heal.toml", keep=("budget_2p3",), formats=("iq2_xxs", "q2_k"))
    run(capsys, "heal", "-c", str(folder / "heal.toml"))
    lake = folder / "lake" / "tables"
    rows = {r["variant"]: r for r in pq.read_table(lake / "frontier.parquet").to_pylist()}
    assert set(rows) == {"unhealed", "budget_2p3"} and rows["budget_2p3"]["routed_bpw"] <= 2.3
    assert rows["budget_2p3"]["eval_kld"] > 0
    assert {r["variant"] for r in pq.read_table(lake / "e2e_curve.parquet").to_pylist()} == {"budget_2p3"}
    assert {r["variant"] for r in pq.read_table(lake / "learned_curve.parquet").to_pylist()} == {"budget_2p3"}
