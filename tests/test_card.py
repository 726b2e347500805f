"""The measured numbers in README.md and the model card are what `make card` writes.

README blocks are re-rendered from the committed lake snapshot (demo/results/),
since building a lake takes minutes; the model card's cross-entropy table is
recomputed from the model itself.
"""

from __future__ import annotations

import pytest

from tests.test_demo import DEMO, load_script

card = load_script("demo_card", DEMO / "card.py")


@pytest.mark.parametrize("document", card.DOCUMENTS, ids=lambda d: d.name)
def test_every_lake_block_matches_its_snapshot(document):
    """README.md and bench/RESULTS.md: every card:<config>.<block> equals a render of the snapshot."""
    readme = card.blocks(document.read_text(encoding="utf-8"))
    prefixes = {name.partition(".")[0] for name in readme}
    assert prefixes, f"{document.name} has no card: blocks"
    for prefix in sorted(prefixes):
        folder = card.RESULTS / prefix
        assert folder.is_dir(), f"no snapshot {folder}: run `make heal` and `make card` for that config"
        rendered = card.readme_blocks(prefix, card.read_snapshot(folder), readme)
        for name, text in rendered.items():
            assert readme[name] == text.rstrip() + "\n", f"card:{name} differs from demo/results/{prefix}/: run make card"


def test_snapshot_round_trips_exactly(tmp_path):
    snap = {"settings": [{"key": "bootstrap", "value": 2000}],
            "comparisons": [{"a": "v1", "kld_a": 0.1 + 0.2, "ci_lo": -1e-17, "clean_wins": None, "same": True}]}
    card.write_snapshot(snap, tmp_path)
    assert card.read_snapshot(tmp_path) == snap


def test_splice_rewrites_only_marked_blocks_and_refuses_missing_markers():
    text = "a 1\n<!-- card:x.y -->\nold\n<!-- /card:x.y -->\nb 2\n<!-- card:z -->\nkeep\n<!-- /card:z -->\n"
    out = card.splice(text, {"x.y": "new\n"})
    assert out == text.replace("old", "new")
    assert card.blocks(out) == {"x.y": "new\n", "z": "keep\n"}
    with pytest.raises(ValueError, match="no markers"):
        card.splice(text, {"gone": "x"})


def test_comparison_rows_follow_the_ladder():
    snap = card.read_snapshot(card.RESULTS / "heal")
    pairs = card._pairs(snap)
    order = card._variant_order(snap)
    kinds = {r["variant"]: r["kind"] for r in snap["variants"]}
    closing = {(order[0], b) for a, b in zip(order, order[1:]) if kinds[b] == "healed" and a != order[0]
               and (order.index(b) + 1 == len(order) or kinds[order[order.index(b) + 1]] != "healed")}
    assert set(pairs) == set(zip(order, order[1:])) | closing  # consecutive steps + unhealed -> each group's best
    table = card.render_comparisons(snap).splitlines()
    assert len(table) == 2 + 2 * len(pairs)  # header, rule, one row per pair and window set


@pytest.mark.slow
def test_model_card_cross_entropy_is_recomputed():
    """Under 30 s on two cores: one forward pass of the demo model over the 32 eval windows."""
    committed = card.blocks(card.MODEL_CARD.read_text(encoding="utf-8"))[card.CE_BLOCK]
    assert committed == card.render_ce(card.eval_window_ce()) + "\n"


@pytest.mark.parametrize("block", ["LOAD_BLOCK", "TRAINING_BLOCK", "HELDOUT_BLOCK", "DATA_BLOCK"])
def test_model_card_training_blocks_match_the_training_files(block):
    """Expert load, training facts and held-out cross-entropy come from train_log.json and export_check.json."""
    render = {"LOAD_BLOCK": card.render_expert_load, "TRAINING_BLOCK": card.render_training,
              "HELDOUT_BLOCK": card.render_heldout_ce, "DATA_BLOCK": card.render_training_data}[block]
    committed = card.blocks(card.MODEL_CARD.read_text(encoding="utf-8"))[getattr(card, block)]
    assert committed == render() + "\n"
