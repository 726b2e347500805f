"""`moeheal init`: a user's model and text in, a folder that `moeheal heal` runs out; bad input leaves nothing.

The models are tiny random transformers models of every supported family, 256 wide so that every
routed row is whole blocks of the ladder's 2-bit formats, exported the way the architecture tests
export them. The text is random-word documents (no 16-gram shared between documents by construction).
"""

from __future__ import annotations

import csv
import json
import random
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.commands.init import LADDER_FORMATS, add_peer
from moeheal.pipeline.config import CAL_TOKENS, load_config
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.sources.package_data import DATA
from moeheal.pipeline.data.documents import read_documents, read_split
from moeheal.pipeline.gguf.tokenizer import build_tokenizer, encode
from bench.inputs.ggufs import _WORDS as WORDS
from bench.inputs.ggufs import make_tiny_gguf, train_tiny_bpe

FAMILIES = ("qwen2moe", "qwen3moe", "olmoe", "mixtral", "deepseek2", "qwen3next")


def random_doc(rng: random.Random, lines: int = 40) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + f" {rng.randint(0, 999)}."
                     for _ in range(lines))


def write_text_folder(root: Path, strata: dict[str, int], seed: int = 0, lines: int = 40) -> Path:
    """`root/<stratum>/doc_i.txt`, `strata[stratum]` documents each."""
    rng = random.Random(seed)
    for stratum, n in strata.items():
        (root / stratum).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (root / stratum / f"doc_{i}.txt").write_text(random_doc(rng, lines), encoding="utf-8")
    return root


def hf_model(family: str, seed: int):
    """(transformers model, tokenizer) of `family`, 256 wide, 2-4 layers."""
    if family in ("qwen2moe", "qwen3moe", "olmoe"):
        from bench.inputs.ggufs import tiny_hf_model

        tokenizer = train_tiny_bpe(seed=seed)
        return tiny_hf_model(family, tokenizer.get_vocab_size(), seed, d_model=256, d_expert=256,
                             d_shexp=256), tokenizer
    if family == "mixtral":
        from tests.test_arch_mixtral import tiny_mixtral, train_tiny_spm

        tokenizer = train_tiny_spm(seed=seed)
        return tiny_mixtral(tokenizer.get_vocab_size(), seed, d_model=256, d_expert=256), tokenizer
    tokenizer = train_tiny_bpe(seed=seed)
    if family == "deepseek2":
        from tests.test_arch_deepseek2 import tiny_deepseek_v3

        return tiny_deepseek_v3(tokenizer.get_vocab_size(), seed, d_model=256, d_expert=256, kv_lora_rank=64,
                                nope=32, rope=16, v_dim=32, q_lora_rank=64), tokenizer
    from tests.test_arch_qwen3next import tiny_qwen3next

    return tiny_qwen3next(tokenizer.get_vocab_size(), seed, d_model=256, d_expert=256, d_shexp=256), tokenizer


def family_gguf(family: str, path: Path, seed: int = 5) -> Path:
    from moeheal.pipeline.sources.convert import hf_to_gguf

    hf, tokenizer = hf_model(family, seed)
    hf_to_gguf(hf, tokenizer, path, matrix_type="q8_0")
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_text_folder(tmp_path_factory.mktemp("texts"), {"prose": 7, "notes": 6})


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory) -> Path:
    return family_gguf("qwen2moe", tmp_path_factory.mktemp("model") / "qwen2moe.gguf")


def shrink(config: Path, keep: tuple[str, ...] | None = None, formats: tuple[str, ...] | None = None) -> None:
    """Test-sized knobs over what init wrote (init's own defaults untouched): 512 calibration and 256
    unseen tokens, 2 learned-rounding and 2 e2e steps against the reference's top 16 tokens, 100
    bootstrap draws, one expert-cache repetition; with `keep`, only those variants (and the `compare` pairs among them); with
    `formats`, the routed recipes choose from those alone (fewer programs to compile)."""
    text = config.read_text(encoding="utf-8")
    if formats is not None:
        routed = f"formats = {json.dumps(list(LADDER_FORMATS))}\n"
        text = text.replace(routed, f"formats = {json.dumps(list(formats))}\n")
    for key, value in (("tokens", 512), ("unseen_tokens", 256), ("seq_tokens", 64), ("bootstrap", 100)):
        text = re.sub(rf"(?m)^{key} = \d+$", f"{key} = {value}", text)
    text = text.replace("e2e = true\n", "e2e = true\ne2e_steps = 2\ne2e_topk = 16\nlearned_steps = 2\n")
    text = text.replace("[moce]\n", "[moce]\nreps = 1\n")
    if keep is not None:
        head, *variants = text.split("\n[[variant]]\n")
        moce = variants[-1][variants[-1].index("[moce]"):]
        variants[-1] = variants[-1][:variants[-1].index("[moce]")]
        kept = [v for v in variants if re.search(r'(?m)^name = "(.*)"$', v)[1] in keep]
        pairs = re.findall(r'(?m)^    \["(.*)", "(.*)"\],\n', head)
        head = re.sub(r'(?m)^    \[".*", ".*"\],\n', "", head).replace(
            "compare = [\n", "compare = [\n" + "".join(f'    ["{a}", "{b}"],\n' for a, b in pairs
                                                    if a in keep and b in keep))
        text = "".join([head, *(f"\n[[variant]]\n{v}" for v in kept), "\n", moce])
    config.write_text(text, encoding="utf-8")


def init(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["init", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


# ---- what init writes ---------------------------------------------------------------------------


def test_init_writes_a_frozen_split_clean_windows_and_a_config_the_run_accepts(qwen2moe, texts, tmp_path, capsys):
    folder = tmp_path / "mine"
    code, out, err = init(capsys, str(folder), "--model", str(qwen2moe), "--text", str(texts), "--seed", "3")
    assert code == 0, err
    assert f"moeheal heal -c {folder / 'heal.toml'}" in out and f"moeheal report -c {folder / 'heal.toml'}" in out
    docs = read_documents(folder / "docs.jsonl")
    assert {d["stratum"] for d in docs} == {"prose", "notes"} and len(docs) == 13
    split = dict(read_split(folder / "split.csv"))
    assert set(split) == {d["doc_id"] for d in docs}
    for stratum in ("prose", "notes"):
        assert {split[d["doc_id"]] for d in docs if d["stratum"] == stratum} == {"cal", "unused", "eval", "canary"}

    # Every scored span shares no 16-gram with any calibration document (tuples, not the pipeline's hashes).
    tok = build_tokenizer(open_model(qwen2moe))
    ids = {d["doc_id"]: encode(tok, d["text"]) for d in docs}
    cal_grams = {tuple(ids[d][i:i + 16]) for d in ids if split[d] == "cal" for i in range(len(ids[d]) - 15)}
    with open(folder / "windows.csv", newline="") as f:
        windows = list(csv.DictReader(f))
    assert {w["set"] for w in windows} == {"eval", "canary"}
    for w in windows:
        assert split[w["doc_id"]] == w["set"]
        start, ctx, scored = int(w["start"]), int(w["ctx_tokens"]), int(w["scored_tokens"])
        doc = ids[w["doc_id"]]
        assert start + ctx + scored <= len(doc)
        score_start = start + ctx
        touching = range(max(0, score_start - 15), score_start + scored - 15)  # 16-grams overlapping the span
        assert not any(tuple(doc[i:i + 16]) in cal_grams for i in touching), w["window_id"]

    cfg = load_config(folder / "heal.toml")
    assert cfg.reference == qwen2moe.resolve()
    assert [v.name for v in cfg.variants] == ["q2_k_healed", "budget_2p625", "budget_2p3"]
    assert [v.budget_bpw for v in cfg.variants] == [None, 2.625, 2.3]
    assert all(v.round == "learned" and v.e2e and v.alpha for v in cfg.variants)  # the levers of budget-64k.toml
    assert [v.measured_round for v in cfg.variants[1:]] == ["ls", "ls"] and cfg.variants[0].quant == "q2_k"
    assert cfg.compare == (("q2_k_healed", "budget_2p625"), ("q2_k_healed", "budget_2p3"))
    assert cfg.cal_tokens == sum(len(ids[d]) for d in ids if split[d] == "cal")  # all of it: under the cap
    assert 0 < cfg.unseen_tokens <= sum(len(ids[d]) for d in ids if split[d] == "unused")
    assert sum(cfg.mix.values()) <= 1

    # Every variant passes the run's checks (formats against the model's rows, the budget's feasibility);
    # healing it is `tests/test_wheel_init.py`'s, from the installed wheel.
    code, out = cli(capsys, "plan", "-c", str(folder / "heal.toml"), "--format", "json")
    assert code == 0
    stages = {p["stage"].split(":")[0] for p in json.loads(out)}
    assert {"quantize:q2_k_healed", "allocate:budget_2p625", "allocate:budget_2p3"} <= \
        {":".join(p["stage"].split(":")[:2]) for p in json.loads(out)} and {"e2e", "sensitivity"} <= stages
    code, out = cli(capsys, "audit", "-c", str(folder / "heal.toml"))
    assert code == 0 and "0 scored-span leaks" in out


def test_the_same_seed_gives_the_same_folder_and_another_seed_another_split(qwen2moe, texts, tmp_path, capsys):
    made = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        code = init(capsys, str(tmp_path / name), "--model", str(qwen2moe), "--text", str(texts), "--seed", seed)[0]
        assert code == 0
        made.append({f: (tmp_path / name / f).read_bytes() for f in ("docs.jsonl", "split.csv", "windows.csv")})
    assert made[0] == made[1]
    assert made[0]["split.csv"] != made[2]["split.csv"] and made[0]["docs.jsonl"] == made[2]["docs.jsonl"]


def test_jsonl_and_parquet_give_strata_from_their_fields(qwen2moe, tmp_path, capsys):
    rng = random.Random(4)
    records = [{"text": random_doc(rng), "stratum": s} for s in ("code", "chat") for _ in range(6)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records[:6]), encoding="utf-8")
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": [r["text"] for r in records[6:]], "stratum": [r["stratum"] for r in records[6:]]}),
                   parquet)
    code, _, err = init(capsys, str(tmp_path / "out"), "--model", str(qwen2moe), "--text", str(jsonl), "--text",
                        str(parquet))
    assert code == 0, err
    docs = read_documents(tmp_path / "out" / "docs.jsonl")
    assert sorted(d["text"] for d in docs) == sorted(r["text"] for r in records)
    assert {d["stratum"] for d in docs} == {"code", "chat"}


def test_without_text_the_bundled_corpus_is_split_by_its_four_strata(qwen2moe, tmp_path, capsys):
    code, _, err = init(capsys, str(tmp_path / "out"), "--model", str(qwen2moe))
    assert code == 0, err
    docs = read_documents(tmp_path / "out" / "docs.jsonl")
    assert {d["stratum"] for d in docs} == {"ops", "chat_json", "ja", "persona"}
    bundled = [json.loads(line) for line in open(DATA / "corpus" / "docs.jsonl", encoding="utf-8")]
    manifest = pq.read_table(DATA / "corpus" / "manifest.parquet").to_pylist()
    assert {m["doc_id"] for m in manifest} == {d["doc_id"] for d in bundled} == {d["doc_id"] for d in docs}
    assert all(m["licence"] for m in manifest)
    demo = {d["doc_id"]: d for d in read_documents(Path(__file__).resolve().parents[1] / "demo" / "docs.jsonl")}
    assert all(demo[d["doc_id"]] == d for d in bundled)  # verbatim demo documents (demo/corpus/bundle.py)
    assert load_config(tmp_path / "out" / "heal.toml").cal_tokens == CAL_TOKENS  # the one default


def test_a_long_text_file_is_cut_at_blank_lines_into_documents(qwen2moe, tmp_path, capsys):
    rng = random.Random(9)
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(random_doc(rng, 20) for _ in range(24)), encoding="utf-8")
    code, _, err = init(capsys, str(tmp_path / "out"), "--model", str(qwen2moe), "--text", str(book))
    assert code == 0, err
    docs = read_documents(tmp_path / "out" / "docs.jsonl")
    assert len(docs) > 4 and {d["stratum"] for d in docs} == {"text"}
    assert "\n\n".join(d["text"] for d in docs) == book.read_text(encoding="utf-8")


@pytest.mark.parametrize("family", FAMILIES[1:])
def test_init_on_every_family_gives_a_config_heal_accepts(family, texts, tmp_path, capsys):
    model = family_gguf(family, tmp_path / f"{family}.gguf")
    folder = tmp_path / "out"
    code, _, err = init(capsys, str(folder), "--model", str(model), "--text", str(texts))
    assert code == 0, err
    code, out = cli(capsys, "plan", "-c", str(folder / "heal.toml"), "--format", "json")
    assert code == 0
    stages = {p["stage"].split(":")[0] for p in json.loads(out)}
    assert {"dump", "quantize", "evaluate"} <= stages
    has_ridge = open_model(model).arch.has_shared_expert
    assert ("ridge_eta" in (folder / "heal.toml").read_text()) == has_ridge

    # A whole-file size: a recipe over every tensor within it, where the family's attention is one the
    # sensitivity prices; one line, exit 2, nothing written where it is not.
    size = str(model.stat().st_size * 3 // 4)  # bytes: three quarters of the Q8_0 file
    code, _, err = init(capsys, str(tmp_path / "sized"), "--model", str(model), "--text", str(texts), "--size", size)
    if not open_model(model).arch.standard_attention:
        assert code == 2 and err.count("\n") == 1 and "attention" in err and not (tmp_path / "sized").exists()
        return
    assert code == 0, err
    cfg = load_config(tmp_path / "sized" / "heal.toml")
    recipe = cfg.variants[-1]
    assert recipe.name == f"budget_file_{size}" and recipe.budget_roles == "all"
    header = model.stat().st_size - sum(b for _, _, b in open_model(model).tensor_sizes().values())
    total = sum(n for _, n, _ in open_model(model).tensor_sizes().values())
    assert int(size) - 8 * total / 1e6 <= header + recipe.budget_bpw * total / 8 <= int(size)  # within, to 1e-6 bit


@pytest.mark.parametrize("family", FAMILIES)
def test_init_converts_a_hugging_face_checkpoint_into_the_folder(family, texts, tmp_path, capsys):
    pytest.importorskip("moeheal.pipeline.sources.hf_checkpoint")
    hf, tokenizer = hf_model(family, seed=5)
    checkpoint = tmp_path / "checkpoint"
    hf.save_pretrained(checkpoint)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    folder = tmp_path / "out"
    code, _, err = init(capsys, str(folder), "--model", str(checkpoint), "--text", str(texts))
    assert code == 0, err
    assert load_config(folder / "heal.toml").reference == folder / "model.gguf"
    assert cli(capsys, "plan", "-c", str(folder / "heal.toml"))[0] == 0


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------


def _bad_inputs(tmp: Path, good_model: Path, good_texts: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty").mkdir(parents=True)
    (tmp / "blank.txt").write_text("  \n\n ", encoding="utf-8")
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    small = write_text_folder(tmp / "small", {"big": 6, "tiny": 2})
    (tmp / "checkpoint").mkdir()
    (tmp / "checkpoint" / "model.safetensors").write_bytes(b"")
    narrow = make_tiny_gguf(tmp / "narrow.gguf", arch="qwen2moe", seed=1)  # 64 wide: no 256-weight block fits
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp / "dense.gguf"), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model, texts = ["--model", str(good_model)], ["--text", str(good_texts)]
    return {
        "no text": (model + ["--text", str(tmp / "blank.txt")], "no text"),
        "empty folder": (model + ["--text", str(tmp / "empty")], "holds no files"),
        "missing file": (model + ["--text", str(tmp / "nope.txt")], "no such file"),
        "not utf-8": (model + ["--text", str(tmp / "latin1.txt")], "not UTF-8"),
        "small stratum": (model + ["--text", str(small)], "'tiny'"),
        "unsupported family": (["--model", str(tmp / "dense.gguf")] + texts, "bert"),
        "no config.json": (["--model", str(tmp / "checkpoint")] + texts, "config.json"),
        "narrow experts": (["--model", str(narrow)] + texts, "not a multiple of"),
        "missing model": (["--model", str(tmp / "nope.gguf")] + texts, "no such file"),
        "bits zero": (model + texts + ["--bits", "0"], "--bits 0: below 2.0625 bits per routed weight"),
        "bits not a number": (model + texts + ["--bits", "2.5", "abc"], "--bits abc: not a number"),
        "bits twice": (model + texts + ["--bits", "2.3", "2.30"], "--bits 2.30: given twice"),
        "bits below iq2_xxs": (model + texts + ["--bits", "2.06"], "(iq2_xxs)"),
        "size unparsable": (model + texts + ["--size", "eleven"], "--size eleven: expected a file size"),
        "size below the cheapest": (model + texts + ["--size", "1K"], "--size 1K: below the smallest whole file"),
    }


def test_bad_input_is_one_line_exit_2_and_leaves_the_folder_untouched(qwen2moe, texts, tmp_path, capsys):
    cases = _bad_inputs(tmp_path / "inputs", qwen2moe, texts)
    target_parent = tmp_path / "targets"
    target_parent.mkdir()
    for name, (argv, expected) in cases.items():
        folder = target_parent / name.replace(" ", "_")
        folder.mkdir()  # an empty folder stays empty; nothing appears beside it
        code, out, err = init(capsys, str(folder), *argv)
        assert code == 2, (name, err)
        assert err.count("\n") == 1 and expected in err, (name, err)
        assert list(folder.iterdir()) == [], name
    assert sorted(p.name for p in target_parent.iterdir()) == sorted(n.replace(" ", "_") for n in cases)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "heal.toml").write_text("mine", encoding="utf-8")
    code, _, err = init(capsys, str(occupied), "--model", str(qwen2moe), "--text", str(texts))
    assert code == 2 and "not an empty folder" in err and err.count("\n") == 1
    assert [p.name for p in occupied.iterdir()] == ["heal.toml"] and (occupied / "heal.toml").read_text() == "mine"


def test_peers_script_only_when_llama_quantize_is_found(qwen2moe, texts, tmp_path, capsys, monkeypatch):
    """peers.sh names the llama-quantize found and makes llama.cpp's files at the ladder's sizes: the uniform
    types at or below the largest of ours and each of ours' twin, each added to heal.toml with a compare pair
    against every one of ours at or above its size. Its add-peer lines are run here; the llama-quantize ones
    need llama.cpp (docs/your-model.md)."""
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    assert init(capsys, str(tmp_path / "without"), "--model", str(qwen2moe), "--text", str(texts))[0] == 0
    assert not (tmp_path / "without" / "peers.sh").exists()
    build = tmp_path / "llama.cpp" / "build"
    (build / "bin").mkdir(parents=True)
    (build / "bin" / "llama-quantize").write_text("#!/bin/sh\n")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(build))
    folder = tmp_path / "with"
    code, out, _ = init(capsys, str(folder), "--model", str(qwen2moe), "--text", str(texts), "--bits", "2.4")
    assert code == 0 and "peers.sh" in out
    script = (folder / "peers.sh").read_text()
    assert str(build / "bin" / "llama-quantize") in script
    assert subprocess.run(["/bin/bash", "-n", str(folder / "peers.sh")]).returncode == 0
    made = {"iq2_xxs_llama": "--variant q2_k_healed --quant iq2_xxs ",
            "iq2_xs_llama": "--variant q2_k_healed --quant iq2_xs ",
            "iq2_s_llama": "--variant q2_k_healed --quant iq2_s ",
            "q2_k_llama": "--variant q2_k_healed --imatrix", "budget_2p4_llama": "--variant budget_2p4 --imatrix"}
    for peer, recipe in made.items():
        assert recipe in script and f"--out peers/{peer}.gguf" in script, peer

    adders = [line.strip() for line in script.splitlines() if "add_peer" in line]
    subprocess.run(["/bin/bash", "-euc", "\n".join(adders)], cwd=folder, check=True)
    # A second run of the script adds nothing twice: the same calls again, in this process (a Python
    # started per line, importing the package each time, was most of this test's time).
    monkeypatch.chdir(folder)
    for line in adders:
        argv = shlex.split(line)
        add_peer(*argv[3:6], argv[6:])  # python -c CODE config name gguf ours...
    cfg = load_config(folder / "heal.toml", peers_may_be_missing=True)
    assert [v.name for v in cfg.variants] == ["q2_k_healed", "budget_2p4", *made]
    assert all(v.kind == "external" and v.gguf == folder / "peers" / f"{v.name}.gguf" for v in cfg.variants[2:])
    assert set(cfg.compare) == {("q2_k_healed", "budget_2p4"),
                                ("iq2_xxs_llama", "q2_k_healed"), ("iq2_xxs_llama", "budget_2p4"),
                                ("iq2_xs_llama", "q2_k_healed"), ("iq2_xs_llama", "budget_2p4"),
                                ("iq2_s_llama", "q2_k_healed"),  # 2.5625 bits: above the 2.4-bit recipe
                                ("q2_k_llama", "q2_k_healed"),  # 2.625 bits: above the 2.4-bit recipe
                                ("budget_2p4_llama", "q2_k_healed"), ("budget_2p4_llama", "budget_2p4")}
    assert len(cfg.compare) == 9

    # `recipe --quant`: the uniform type the script asks llama-quantize for, every routed tensor in it.
    code, command = cli(capsys, "recipe", "-c", str(folder / "heal.toml"), "--variant", "q2_k_healed", "--quant",
                        "iq2_xs", "--imatrix", "m.gguf", "--out", "o.gguf")
    assert code == 0 and "blk.0.ffn_gate_exps=iq2_xs" in command and "=q2_k" not in command
    code = main(["recipe", "-c", str(folder / "heal.toml"), "--variant", "budget_2p4", "--quant", "q2_k"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "fixed formats" in err
