"""The measured numbers in README.md, demo/README.md, bench/RESULTS.md and the model card are what `make card` writes.

Their blocks are re-rendered from the committed lake snapshot (demo/results/),
since building a lake takes minutes; the model card's cross-entropy table is
recomputed from the model itself.
"""

from __future__ import annotations

import pytest

from tests.test_demo import DEMO, load_script

card = load_script("demo_card", DEMO / "card.py")


@pytest.mark.parametrize("document", card.DOCUMENTS, ids=lambda d: str(d.relative_to(card.REPO)))
def test_every_lake_block_matches_its_snapshot(document):
    """README.md, demo/README.md and bench/RESULTS.md: every card:<config>.<block> equals a render of the snapshot."""
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


@pytest.mark.parametrize("config", ["heal", "uniform-8k"])
def test_comparison_rows_follow_the_ladder(config):
    snap = card.read_snapshot(card.RESULTS / config)
    pairs = card._pairs(snap)
    order = card._variant_order(snap)
    kinds = {r["variant"]: r["kind"] for r in snap["variants"]}
    closing = {(order[0], b) for a, b in zip(order, order[1:]) if kinds[b] == "healed" and a != order[0]
               and (order.index(b) + 1 == len(order) or kinds[order[order.index(b) + 1]] != "healed")}
    assert set(pairs) == set(zip(order, order[1:])) | closing  # consecutive steps + unhealed -> each group's best
    table = card.render_comparisons(snap).splitlines()
    assert len(table) == 2 + 2 * len(pairs)  # header, rule, one row per pair and window set


def test_headline_pairs_each_peer_with_ours_at_its_size():
    """The earlier ladder's headline (bench/RESULTS.md): rows are `[eval] compare` pairs of an outside GGUF
    and one of ours whose routed experts take the same bits, in the config's order, with the eval and
    canary rows' numbers."""
    snap = card.read_snapshot(card.RESULTS / "uniform-8k")
    kinds = {r["variant"]: r["kind"] for r in snap["variants"]}
    bits = {r["variant"]: r["routed_bpw"] for r in snap["sizes"]}
    rows = [line.split(" | ") for line in card.render_headline(snap).splitlines()[2:]]
    shown = [(r[1], r[2]) for r in rows]
    assert shown == [(a, b) for a, b in card._compare_pairs(snap)
                     if kinds[a] == "external" and kinds[b] == "healed" and bits[a] == bits[b]]
    assert shown, "the demo's config compares ours with a peer of the same size"
    assert ("q2_k_imatrix", "iq2_xxs_healed") not in shown  # a peer of another size is not a like-for-like row
    index = {(r["set"], r["a"], r["b"]): r for r in snap["comparisons"] if r["moce_bonus_a"] == 0 and r["moce_bonus"] == 0}
    for (a, b), row in zip(shown, rows):
        assert row[3] == f"{index['eval', a, b]['kld_a']:.4f} → {index['eval', a, b]['kld_b']:.4f}"
        assert row[5].startswith(card._signed(index["canary", a, b]["delta_pct"], 1))


def test_frontier_is_the_best_file_of_each_side_at_each_size():
    """README's headline: at each size a recipe of the demo is budgeted to, the file of ours and the
    outside file with the lowest eval KLD among those no larger, and their ratios as frontier_pairs holds them."""
    snap = card.read_snapshot(card.RESULTS / "heal")
    files = snap["frontier"]
    sizes = sorted({r["budget_bpw"] for r in files if r["side"] == "ours" and r["budget_bpw"] is not None})
    rows = card.frontier_rows(snap)
    assert [size for size, _, _ in rows] == sizes and len(sizes) == 2  # init's --bits 2.625 and 2.3
    for size, ours, peer in rows:
        for best, side in ((ours, "ours"), (peer, "peer")):
            assert best["side"] == side and best["routed_bpw"] <= size + 1e-9
            assert all(r["eval_kld"] >= best["eval_kld"] for r in files
                       if r["side"] == side and r["routed_bpw"] <= size + 1e-9)
    pairs = {(r["set"], r["ours"], r["peer"]): r for r in snap["frontier_pairs"]}
    table = card.render_frontier(snap).splitlines()[2:]
    assert len(table) == len(rows)
    for line, (size, ours, peer) in zip(table, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1].startswith(ours["variant"] + " ") and cells[2].startswith(peer["variant"] + " ")
        for set_name, ratio_cell in (("eval", 4), ("canary", 6)):
            r = pairs[(set_name, ours["variant"], peer["variant"])]  # every frontier pair is compared, with its CI
            assert cells[ratio_cell] == f"{r['ratio']:.3f}x [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]"


def test_at_size_rows_are_peers_no_smaller_than_ours():
    """README's 65,536-token figures: each outside file against each of ours no larger, ratio = 1 + Δ."""
    snap = card.read_snapshot(card.RESULTS / "budget-64k")
    bits = {r["variant"]: r["routed_bpw"] for r in snap["sizes"]}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in card.render_at_size(snap).splitlines()[2:]]
    assert rows
    for cells in rows:
        ours, peer = cells[0].split(" ")[0], cells[1].split(" ")[0]
        assert bits[ours] <= bits[peer] + 1e-9 and [peer, ours] in [list(p) for p in card._compare_pairs(snap)]


@pytest.mark.long
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
