"""`heal.toml` -> validated, frozen dataclasses.

Every path in the file is relative to the file itself. Unknown keys, missing
files and bad values raise `InputError` naming the file and the key, so a typo
never silently falls back to a default (the audit's sweeps that "changed" a
knob nobody read).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moeheal.kernels.encode import ENCODERS
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.data.dumps import DUMP_DTYPES

ROUNDINGS = ("ls", "gptq")
# `round = "learned"`: GPTQ's codes and scales (least squares' where a format has no GPTQ) tuned on the
# MoE layer's output (kernels/learned.py); a budget's sensitivity is still measured with "ls" or "gptq".
LEARNED = "learned"
# The default `learned_steps`, 0: one pass over the calibration rows it trains on, at least 32 steps
# (pipeline/stages/quantize.py, `learned_schedule`); a number sets that many steps of 256 tokens.
LEARNED_STEPS = 0
# `learned_loss`: what learned rounding minimises. "output": the layer's output error, every token and channel
# alike; "fisher": each squared error weighted by the reference's Fisher information with respect to that
# output (the guidance stage, pipeline/stages/guidance.py: what an error there costs the model's prediction);
# "fisher_channels": that weight averaged over the rows, one per output channel (a one-draw estimate per
# token is heavy-tailed; its mean over 65,536 rows is not). Both measured worse than "output" on the demo
# (demo/ablations/fisher.toml, docs/learned-rounding.md).
LEARNED_LOSSES = ("output", "fisher", "fisher_channels")
# `inputs`: what a variant's layer L is quantized and healed on. "reference": the reference's MoE inputs
# (the calibration dump), every (variant, layer) unit independent; "healed": the inputs the model with its
# layers before L already healed makes (pipeline/stages/healed_dump.py), the reference's output still the
# target, so the layers of such a variant are built in order (AutoRound's quantized inputs, GPTQ's
# sequential mode).
INPUTS = ("reference", "healed")
HEALED_INPUTS = "healed"
# `[calibration] tokens` when the file does not say, and what `moeheal init` writes: AutoRound's default
# (128 x 512); on the demo's curve every method gains up to it and is flat within its CIs past it
# (demo/ablations/data-curve.toml, bench/experiments/data_curve.py, README "How much text").
CAL_TOKENS = 65536
# `budget_roles`: which tensors a `budget_bpw` covers and the allocation chooses formats for: "routed"
# the routed experts; "all" every tensor of the file, the formats chosen for the routed experts', the
# shared expert's and attention's (`pipeline.model.roles`), the rest counted as the source stores it.
BUDGET_ROLES = ("routed", "all")
# `quant = { gate = ..., up = ..., down = ... }`: the routed-expert tensor of each role.
EXPERT_ROLES = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
# `e2e = true`'s defaults, chosen on the demo's unseen trace (never its evaluation windows) by
# bench/experiments/e2e_sweep.py (docs/e2e-tuning.md): the norms and routers at 2e-3; the fp16 block scales, most
# of the tuned values and the quickest to fit the calibration text, at a quarter of it; at least 40 steps,
# where IQ2_XXS still gains and Q2_K has passed its best at 8,192 tokens (the stage keeps the best measured step).
# `e2e_steps = 0`, the default, is one pass over the variant's calibration sequences, at least E2E_MIN_STEPS
# (`e2e_schedule`): 40 at 8,192 tokens, 128 at 65,536, 256 at 131,072. On the data curve's unseen trace the
# KL was still falling at step 40 with 64k and 128k tokens (demo/ablations/data-curve.toml, docs/e2e-tuning.md).
E2E_STEPS = 0
E2E_MIN_STEPS = 40
E2E_LR = 2e-3
E2E_SCALE_LR = 5e-4
# The reference's distribution e2e tunes against: its top E2E_TOPK tokens per position plus one bucket
# for the rest (pipeline/stages/reference_topk.py); at or above the vocabulary, the whole of it. On the
# demo's unseen trace the loss at 1024 is 99.93-99.94% of the full-vocabulary KL (256: 99.3%; 64: 96.5%;
# bench/experiments/e2e_topk.py, docs/e2e-tuning.md); stored, 8 KB per token, 100 MB for 12,288 tokens at any vocabulary.
E2E_TOPK = 1024


@dataclass(frozen=True)
class Variant:
    """One `[[variant]]`: a full set of healing knobs, or an outside GGUF."""

    name: str
    kind: str  # "healed" or "external"
    quant: str | tuple[tuple[str, str], ...] = "tq2_0"  # one format, or (role, format) per expert role
    beta_gate_up: float = 0.5
    beta_down: float = 0.5
    down_blend_tokens: float = 16.0
    alpha: bool = True
    ridge_rho: float = 6.0
    ridge_eta: float = 0.15
    shexp_down: str = "iq4_nl"
    round: str = "ls"
    gptq_damp: float = 1.0
    gptq_shrink: float = 64.0
    gptq_router_weighted: bool = False  # weight each token's share of an expert's H by its routing weight
    learned_steps: int = LEARNED_STEPS  # round = "learned": Adam steps of 256 tokens on the layer's output; 0 one pass
    learned_loss: str = "output"  # LEARNED_LOSSES: the plain output error, or weighted by the reference's Fisher
    importance: bool = True
    cal_tokens: int = 0  # 0 = the whole calibration dump; else its first cal_tokens rows
    inputs: str = "reference"  # INPUTS: the reference's MoE inputs, or those of the model healed up to the layer
    budget_bpw: float | None = None  # set: one format per (layer, role) chosen from `candidates` under this budget
    candidates: tuple[str, ...] = ()  # `formats = [...]`: the formats the allocation may choose from
    budget_roles: str = "routed"  # which tensors the budget counts and chooses formats for (BUDGET_ROLES)
    sensitivity_round: str = ""  # rounding of the per-tensor sensitivity measurement; "" = the variant's `round`
    e2e: bool = False  # tune the file's float parameters on the model's output after assembly (pipeline/stages/e2e.py)
    e2e_steps: int = E2E_STEPS  # steps of `e2e_batch_seqs` calibration sequences; 0: one pass (e2e_schedule), resolved on load
    e2e_batch_seqs: int = 1  # calibration sequences per step (the learning rates above were chosen at 1)
    e2e_lr: float = E2E_LR  # the norms' and routers' learning rate
    e2e_scale_lr: float = E2E_SCALE_LR  # the fp16 block scales'
    e2e_topk: int = E2E_TOPK  # the reference's tokens kept per position for the loss (the rest: one bucket)
    e2e_code_lr: float = 0.0  # the k-quants' sub-block scale codes' step (code units); 0: the codes stay frozen
    e2e_decay: bool = False  # the steps decay linearly to 0 over `e2e_steps` (true) or stay constant (false)
    gguf: Path | None = None

    @property
    def measured_round(self) -> str:
        """The rounding the sensitivity table measures a budget variant's candidates with (learned
        rounding's is its GPTQ start: tuning every candidate of every tensor would cost the most)."""
        return self.sensitivity_round or ("gptq" if self.round == LEARNED else self.round)

    @property
    def uses_gptq(self) -> bool:
        """Whether GPTQ rounds the variant's tensors: round = "gptq", or "learned" (its start)."""
        return self.round in ("gptq", LEARNED)

    @property
    def budgeted(self) -> bool:
        return self.budget_bpw is not None

    def candidate_formats(self) -> tuple[str, ...]:
        """Every format this variant's routed experts may be written in."""
        return self.candidates if self.budgeted else tuple(sorted(set(self.formats().values())))

    def formats(self) -> dict[str, str]:
        """The format of each routed-expert tensor: {"ffn_gate_exps": "q2_k", ...} (one per role for
        every layer; a budget variant's come from its allocation, per layer)."""
        if self.budgeted:
            raise ValueError(f"{self.name}: a budget variant's formats are chosen per layer by its allocation")
        per_role = dict(self.quant) if isinstance(self.quant, tuple) else dict.fromkeys(EXPERT_ROLES, self.quant)
        return {tensor: per_role[role] for role, tensor in EXPERT_ROLES.items()}

    def knobs(self) -> dict[str, Any]:
        """The parameters that define what this variant computes (its fingerprint input)."""
        if self.kind == "external":
            return {"gguf": str(self.gguf)}
        if self.budgeted:
            quant = {"budget_bpw": self.budget_bpw, "formats": list(self.candidates), "budget_roles": self.budget_roles,
                     "sensitivity_round": self.measured_round}
        else:
            quant = {"quant": self.quant if isinstance(self.quant, str) else dict(self.quant)}
        return {
            **quant, "beta_gate_up": self.beta_gate_up, "beta_down": self.beta_down,
            "down_blend_tokens": self.down_blend_tokens, "alpha": self.alpha,
            "ridge_rho": self.ridge_rho, "ridge_eta": self.ridge_eta, "shexp_down": self.shexp_down,
            "round": self.round, "gptq_damp": self.gptq_damp, "gptq_shrink": self.gptq_shrink,
            "gptq_router_weighted": self.gptq_router_weighted,
            "importance": self.importance, "cal_tokens": self.cal_tokens,
            **({"learned_steps": self.learned_steps} if self.round == LEARNED else {}),
            **({"learned_loss": self.learned_loss} if self.fisher_weighted else {}),
            **({"inputs": self.inputs} if self.healed_inputs else {}),
        }

    @property
    def fisher_weighted(self) -> bool:
        """Whether learned rounding weighs the output error by the guidance stage's Fisher estimate."""
        return self.round == LEARNED and self.learned_loss != "output"

    @property
    def healed_inputs(self) -> bool:
        """Whether layer L is quantized and healed on the inputs of the model healed up to it."""
        return self.inputs == HEALED_INPUTS

    def e2e_knobs(self) -> dict[str, Any]:
        """The end-to-end tuning's knobs (empty without it): apart from `knobs`, which the assembled
        GGUF depends on, so an e2e knob re-runs the tuning only."""
        return ({"e2e": True, "e2e_steps": self.e2e_steps, "e2e_lr": self.e2e_lr,
                 "e2e_scale_lr": self.e2e_scale_lr, "e2e_topk": self.e2e_topk,
                 **({"e2e_code_lr": self.e2e_code_lr} if self.e2e_code_lr else {}),
                 **({"e2e_decay": True} if self.e2e_decay else {}),
                 **({"e2e_batch_seqs": self.e2e_batch_seqs} if self.e2e_batch_seqs != 1 else {})} if self.e2e else {})


# The contract's baseline: same format, no calibration data, no alpha, no ridge.
UNHEALED = Variant(name="unhealed", kind="unhealed", importance=False, alpha=False, ridge_rho=0.0,
                   round="ls")


@dataclass(frozen=True)
class WindowGeneration:
    """`[eval] generate`: windows drawn from the eval/canary docs instead of a windows file."""

    eval_per_stratum: int
    canary_per_stratum: int
    ctx_tokens: int
    scored_tokens: int


@dataclass(frozen=True)
class Config:
    path: Path
    lake_root: Path
    reference: Path
    source: Path
    docs: Path
    split: Path
    cal_tokens: int
    seq_tokens: int
    mix: dict[str, float]
    unseen_tokens: int
    cal_seed: int
    dump_chunk_tokens: int
    windows: Path | None
    window_generation: WindowGeneration | None
    ngram: int
    bootstrap: int
    eval_seed: int
    variants: tuple[Variant, ...]
    moce_bonus: tuple[float, ...]
    cache_experts: int
    moce_reps: int = 2
    compare: tuple[tuple[str, str], ...] = ()  # `[eval] compare`: pairs beyond the ladder's
    imported_dumps: dict[str, Path] = field(default_factory=dict)  # trace -> spec of an outside dump
    dump_dtype: str = "float32"  # `[calibration] dump_dtype`: how the dumps store mixed, yr, hh, attn_in
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def healed_variants(self) -> tuple[Variant, ...]:
        return tuple(v for v in self.variants if v.kind == "healed")


_SCHEMA: dict[str, set[str]] = {
    "lake": {"root"},
    "model": {"reference", "source"},
    "corpus": {"docs", "split"},
    "calibration": {"tokens", "seq_tokens", "mix", "unseen_tokens", "seed", "dump_chunk_tokens", "dump_dtype",
                    "import_dump", "import_unseen_dump"},
    "eval": {"windows", "generate", "ngram", "bootstrap", "seed", "compare"},
    "eval.generate": {"eval_per_stratum", "canary_per_stratum", "ctx_tokens", "scored_tokens"},
    "moce": {"bonus", "cache_experts", "reps"},
    "variant": {"name", "quant", "beta_gate_up", "beta_down", "down_blend_tokens", "alpha",
                "ridge_rho", "ridge_eta", "shexp_down", "round", "gptq_damp", "gptq_shrink",
                "gptq_router_weighted", "importance", "cal_tokens", "inputs", "budget_bpw", "formats", "budget_roles",
                "sensitivity_round", "gguf", "learned_steps", "learned_loss", "e2e", "e2e_steps", "e2e_lr",
                "e2e_scale_lr", "e2e_topk", "e2e_code_lr", "e2e_decay", "e2e_batch_seqs"},
}


class _Reader:
    """Typed access to one TOML table that remembers the key path for error messages."""

    def __init__(self, file: Path, section: str, table: dict[str, Any]):
        self.file, self.section, self.table = file, section, table
        unknown = sorted(set(table) - _SCHEMA[section.split("[")[0].strip()])
        if unknown:
            self.fail(unknown[0], "unknown key")

    def fail(self, key: str, why: str) -> None:
        raise InputError(f"{self.file}: [{self.section}] {key}: {why}")

    def get(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        if key not in self.table:
            if required:
                self.fail(key, "missing")
            return default
        value = self.table[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(key, f"expected {kind.__name__}, got {value!r}")
        return value

    def number(self, key: str, kind: type, default: Any, lo: float, hi: float = float("inf")) -> Any:
        value = self.get(key, kind, default)
        if not lo <= value <= hi:
            self.fail(key, f"{value!r} out of range [{lo}, {hi}]")
        return value

    def path(self, key: str, base: Path, default: str | None = None, must_exist: bool = True) -> Path:
        value = self.get(key, str, default, required=default is None)
        resolved = (base / value).resolve()
        if must_exist and not resolved.exists():
            self.fail(key, f"file not found: {resolved}")
        return resolved

    def choice(self, key: str, options: tuple[str, ...], default: str) -> str:
        value = self.get(key, str, default)
        if value not in options:
            self.fail(key, f"{value!r} is not one of {', '.join(options)}")
        return value


def _variant(file: Path, base: Path, index: int, table: dict[str, Any], peers_may_be_missing: bool = False) -> Variant:
    r = _Reader(file, f"variant[{index}]", table)
    name = r.get("name", str, required=True)
    if "gguf" in table:
        extra = sorted(set(table) - {"name", "gguf"})
        if extra:
            r.fail(extra[0], "an external variant (gguf = ...) takes no healing knobs")
        return Variant(name=name, kind="external", gguf=r.path("gguf", base, must_exist=not peers_may_be_missing))
    budget = _budget(r)
    variant = Variant(
        name=name, kind="healed",
        quant="tq2_0" if budget else _quant(r),
        **budget,
        beta_gate_up=r.number("beta_gate_up", float, 0.5, 0.0, 4.0),
        beta_down=r.number("beta_down", float, 0.5, 0.0, 4.0),
        down_blend_tokens=r.number("down_blend_tokens", float, 16.0, 0.0),
        alpha=r.get("alpha", bool, True),
        ridge_rho=r.number("ridge_rho", float, 6.0, 0.0),
        ridge_eta=r.number("ridge_eta", float, 0.15, 0.0, 1.0),
        shexp_down=r.choice("shexp_down", tuple(sorted(ENCODERS)), "iq4_nl"),
        round=r.choice("round", (*ROUNDINGS, LEARNED), "ls"),
        gptq_damp=r.number("gptq_damp", float, 1.0, 0.0),
        gptq_shrink=r.number("gptq_shrink", float, 64.0, 0.0),
        gptq_router_weighted=r.get("gptq_router_weighted", bool, False),
        importance=r.get("importance", bool, True),
        cal_tokens=r.number("cal_tokens", int, 0, 0, 1 << 26),
        inputs=r.choice("inputs", INPUTS, "reference"),
        learned_steps=r.number("learned_steps", int, LEARNED_STEPS, 0, 1 << 20),
        learned_loss=r.choice("learned_loss", LEARNED_LOSSES, "output"),
        e2e=r.get("e2e", bool, False),
        e2e_steps=r.number("e2e_steps", int, E2E_STEPS, 0, 1 << 20),
        e2e_lr=r.number("e2e_lr", float, E2E_LR, 0.0, 1.0),
        e2e_scale_lr=r.number("e2e_scale_lr", float, E2E_SCALE_LR, 0.0, 1.0),
        e2e_topk=r.number("e2e_topk", int, E2E_TOPK, 1, 1 << 24),
        e2e_code_lr=r.number("e2e_code_lr", float, 0.0, 0.0, 1.0),
        e2e_decay=r.get("e2e_decay", bool, False),
        e2e_batch_seqs=r.number("e2e_batch_seqs", int, 1, 1, 4096),
    )
    _refuse_knobs_without_effect(r, variant)
    return variant


def _quant(r: _Reader) -> str | tuple[tuple[str, str], ...]:
    """`quant = "q2_k"` or `quant = { gate = "q2_k", up = "q2_k", down = "q3_k" }`: any registered format."""
    value = r.table.get("quant", "tq2_0")
    per_role = value if isinstance(value, dict) else {role: value for role in EXPERT_ROLES}
    if not isinstance(value, (str, dict)) or set(per_role) != set(EXPERT_ROLES):
        r.fail("quant", f"expected a format name or a table with keys {', '.join(EXPERT_ROLES)}, got {value!r}")
    for role, fmt in per_role.items():
        if fmt not in ENCODERS:
            r.fail("quant" if isinstance(value, str) else f"quant.{role}",
                   f"{fmt!r} is not one of {', '.join(sorted(ENCODERS))}")
    return value if isinstance(value, str) else tuple((role, per_role[role]) for role in EXPERT_ROLES)


def _budget(r: _Reader) -> dict[str, Any]:
    """`budget_bpw = 2.3`, `formats = [...]`, `budget_roles`: the allocation's knobs (empty without a budget).

    The formats are registered names, each once; a budget over the routed
    experts must admit the cheapest of them everywhere (a budget over the whole
    file is checked against the model, in `HealRun`). `quant` has no effect
    beside a budget.
    """
    if "budget_bpw" not in r.table:
        for key in ("formats", "budget_roles", "sensitivity_round"):
            if key in r.table:
                r.fail(key, "has no effect without budget_bpw")
        return {}
    if "quant" in r.table:
        r.fail("quant", "has no effect with budget_bpw: the allocation chooses each tensor's format from `formats`")
    budget = r.number("budget_bpw", float, None, 0.0)
    candidates = r.get("formats", list, required=True)
    if not candidates or not all(isinstance(f, str) for f in candidates) or len(set(candidates)) != len(candidates):
        r.fail("formats", f"expected a non-empty list of distinct format names, got {candidates!r}")
    for fmt in candidates:
        if fmt not in ENCODERS:
            r.fail("formats", f"{fmt!r} is not one of {', '.join(sorted(ENCODERS))}")
    roles = r.choice("budget_roles", BUDGET_ROLES, "routed")
    cheapest = min(candidates, key=lambda f: ENCODERS[f].bits_per_weight)
    if roles == "routed" and budget < ENCODERS[cheapest].bits_per_weight:  # "all": checked against the model
        r.fail("budget_bpw", f"{budget!r} bits per weight is infeasible: the cheapest of formats, {cheapest}, "
                             f"takes {ENCODERS[cheapest].bits_per_weight:g}")
    # The sensitivity table quantizes every candidate of every tensor; "ls" there keeps it cheap
    # while the chosen recipe is still quantized with the variant's own rounding.
    measured = r.choice("sensitivity_round", ROUNDINGS, "") if "sensitivity_round" in r.table else ""
    return {"budget_bpw": budget, "candidates": tuple(candidates), "budget_roles": roles,
            "sensitivity_round": measured}


# Knobs that only reach the computation under a condition, and that condition.
_CONDITIONAL_KNOBS = {
    "gptq_damp": (lambda v: v.uses_gptq, 'is only used with round = "gptq" or "learned"'),
    "gptq_shrink": (lambda v: v.uses_gptq, 'is only used with round = "gptq" or "learned"'),
    "gptq_router_weighted": (lambda v: v.uses_gptq, 'is only used with round = "gptq" or "learned"'),
    "learned_steps": (lambda v: v.round == LEARNED, 'is only used with round = "learned"'),
    "learned_loss": (lambda v: v.round == LEARNED, 'is only used with round = "learned"'),
    "inputs": (lambda v: v.importance, "has no effect with importance = false: no calibration rows are read"),
    "beta_gate_up": (lambda v: v.importance, "has no effect with importance = false"),
    "beta_down": (lambda v: v.importance, "has no effect with importance = false"),
    "down_blend_tokens": (lambda v: v.importance, "has no effect with importance = false"),
    "ridge_eta": (lambda v: v.ridge_rho > 0, "has no effect with ridge_rho = 0 (no ridge)"),
    "e2e_steps": (lambda v: v.e2e, "has no effect without e2e = true"),
    "e2e_lr": (lambda v: v.e2e, "has no effect without e2e = true"),
    "e2e_scale_lr": (lambda v: v.e2e, "has no effect without e2e = true"),
    "e2e_topk": (lambda v: v.e2e, "has no effect without e2e = true"),
    "e2e_code_lr": (lambda v: v.e2e, "has no effect without e2e = true"),
    "e2e_decay": (lambda v: v.e2e, "has no effect without e2e = true"),
    "e2e_batch_seqs": (lambda v: v.e2e, "has no effect without e2e = true"),
    "shexp_down": (lambda v: not (v.budgeted and v.budget_roles == "all"),
                   'has no effect with budget_roles = "all": the allocation chooses the shared down projection\'s format'),
}


def _refuse_knobs_without_effect(r: _Reader, variant: Variant) -> None:
    """A knob set in the file that cannot change the output is an error, never silently ignored."""
    if variant.uses_gptq and not variant.importance:
        r.fail("round", f'"{variant.round}" needs calibration statistics (H = E[x x^T]), but importance = false')
    for fmt in variant.candidate_formats():
        if variant.round == "gptq" and not ENCODERS[fmt].supports_gptq:
            r.fail("round", f'"gptq" is not defined for {fmt} (no per-block scales to fix as columns go)')
    if variant.uses_gptq and variant.gptq_damp <= 0:
        r.fail("gptq_damp", f"{variant.gptq_damp!r} must be > 0: an undamped H can be singular")
    for key, (applies, why) in _CONDITIONAL_KNOBS.items():
        if key in r.table and not applies(variant):
            r.fail(key, why)
    if "sensitivity_round" in r.table and variant.sensitivity_round == variant.round:
        r.fail("sensitivity_round", f'has no effect: the variant\'s round is "{variant.round}" already')
    if variant.round == LEARNED and variant.sensitivity_round == "gptq":
        r.fail("sensitivity_round", 'has no effect: round = "learned" measures with "gptq", its start, already')
    if variant.sensitivity_round == "gptq" and variant.round != LEARNED:
        r.fail("sensitivity_round", '"gptq" is only measured with the variant\'s own GPTQ knobs: set round = "gptq"')


def _windows(file: Path, base: Path, ev: _Reader) -> tuple[Path | None, WindowGeneration | None]:
    """Exactly one of `[eval] windows` (a file) and `[eval] generate` (counts and lengths)."""
    if ("windows" in ev.table) == ("generate" in ev.table):
        ev.fail("windows", "give either a windows file or a `generate` table, not both or neither")
    if "windows" in ev.table:
        return ev.path("windows", base), None
    gen = _Reader(file, "eval.generate", ev.get("generate", dict))
    return None, WindowGeneration(
        eval_per_stratum=gen.number("eval_per_stratum", int, 8, 0, 10**5),
        canary_per_stratum=gen.number("canary_per_stratum", int, 2, 0, 10**5),
        ctx_tokens=gen.number("ctx_tokens", int, 192, 0, 1 << 20),
        scored_tokens=gen.number("scored_tokens", int, 64, 1, 1 << 20),
    )


def e2e_schedule(cal_tokens: int, seq_tokens: int, batch_seqs: int = 1) -> int:
    """`e2e_steps = 0`'s steps: one pass over the calibration sequences e2e draws from (`batch_seqs`
    sequences a step), at least E2E_MIN_STEPS. Resolved when the config is loaded, so the e2e unit's
    key holds the steps it runs and a variant whose pass is shorter than the minimum keeps the key it had."""
    return max(E2E_MIN_STEPS, -(-cal_tokens // (seq_tokens * batch_seqs)))


def load_config(path: str | Path, peers_may_be_missing: bool = False) -> Config:
    """Parse and validate `heal.toml`; raise InputError naming the key on any problem.

    `peers_may_be_missing` lets an outside variant's GGUF be absent: the commands that read
    no peer (`audit`, `dump`, the `recipe` and `imatrix` that help make one) run before its
    file exists; without it a missing peer is the usual one line naming the file and its key."""
    file = Path(path).resolve()
    if not file.is_file():
        raise InputError(f"{file}: config file not found")
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{file}: not valid TOML: {exc}") from None
    base = file.parent
    unknown = sorted(set(raw) - set(_SCHEMA) - {"variant"})
    if unknown:
        raise InputError(f"{file}: [{unknown[0]}]: unknown section")
    section = {name: _Reader(file, name, raw.get(name, {})) for name in
               ("lake", "model", "corpus", "calibration", "eval", "moce")}
    lake, model, corpus = section["lake"], section["model"], section["corpus"]
    cal, ev, moce = section["calibration"], section["eval"], section["moce"]

    reference = model.path("reference", base)
    source_name = model.get("source", str, "")
    source = model.path("source", base) if source_name else reference

    mix = cal.get("mix", dict, {})
    for stratum, share in mix.items():
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1:
            cal.fail(f"mix.{stratum}", f"share must be a number in [0, 1], got {share!r}")
    if sum(mix.values()) > 1 + 1e-9:
        cal.fail("mix", "shares add up to more than 1")

    variants_raw = raw.get("variant", [])
    if not isinstance(variants_raw, list):
        raise InputError(f"{file}: [[variant]]: must be an array of tables")
    variants = tuple(_variant(file, base, i, t, peers_may_be_missing) for i, t in enumerate(variants_raw))
    names = [v.name for v in variants]
    if cal.table.get("unseen_tokens", 8192) == 0:
        for i, v in enumerate(variants):
            if v.budgeted:
                raise InputError(f"{file}: [variant[{i}]] budget_bpw: needs [calibration] unseen_tokens > 0 "
                                 "(the sensitivity of each tensor is measured on the unseen dump)")
            if v.e2e:
                raise InputError(f"{file}: [variant[{i}]] e2e: needs [calibration] unseen_tokens > 0 "
                                 "(the tuning stops on the unseen trace's KL)")
    for name in names:
        if names.count(name) > 1 or name == UNHEALED.name:
            raise InputError(f"{file}: [[variant]] name: {name!r} is reserved or used twice")

    bonus = moce.get("bonus", list, [0.0])
    if not bonus or any(not isinstance(b, (int, float)) or isinstance(b, bool) or b < 0 for b in bonus):
        moce.fail("bonus", f"expected a non-empty list of numbers >= 0, got {bonus!r}")
    bonuses = tuple(sorted({float(b) for b in bonus} | {0.0}))

    compare = ev.get("compare", list, [])
    for pair in compare:
        if (not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(n, str) for n in pair)
                or not set(pair) <= {UNHEALED.name, *names}):
            ev.fail("compare", f"each entry is [a, b], two variant names of this config; got {pair!r}")

    seq_tokens = cal.number("seq_tokens", int, 512, 16, 1 << 20)
    cal_tokens = cal.number("tokens", int, CAL_TOKENS, 1, 1 << 26)
    variants = tuple(replace(v, e2e_steps=e2e_schedule(min(v.cal_tokens or cal_tokens, cal_tokens), seq_tokens,
                                                       v.e2e_batch_seqs))
                     if v.e2e and not v.e2e_steps else v for v in variants)
    windows, generation = _windows(file, base, ev)
    return Config(
        path=file,
        lake_root=(base / lake.get("root", str, "lake")).resolve(),
        reference=reference, source=source,
        docs=corpus.path("docs", base), split=corpus.path("split", base),
        cal_tokens=cal_tokens,
        seq_tokens=seq_tokens,
        mix={k: float(v) for k, v in mix.items()},
        unseen_tokens=cal.number("unseen_tokens", int, 8192, 0, 1 << 26),
        cal_seed=cal.number("seed", int, 0, 0),
        dump_chunk_tokens=cal.number("dump_chunk_tokens", int, 4 * seq_tokens, 1, 1 << 26),
        dump_dtype=cal.choice("dump_dtype", DUMP_DTYPES, "float32"),
        windows=windows,
        window_generation=generation,
        ngram=ev.number("ngram", int, 16, 2, 1024),
        bootstrap=ev.number("bootstrap", int, 10000, 100, 10**6),
        eval_seed=ev.number("seed", int, 0, 0),
        variants=variants,
        moce_bonus=bonuses,
        cache_experts=moce.number("cache_experts", int, 8, 1),
        moce_reps=moce.number("reps", int, 2, 1, 16),
        compare=tuple((a, b) for a, b in compare),
        imported_dumps={trace: cal.path(key, base) for trace, key in
                        (("calibration", "import_dump"), ("unseen", "import_unseen_dump")) if key in cal.table},
        raw=raw,
    )


def without_unmade_peers(cfg: Config) -> Config:
    """`cfg` less its outside variants whose GGUF is not made yet, and less the `[eval] compare`
    pairs that name one: the run of a command that reads no peer (`cfg` loaded with
    `peers_may_be_missing`).

    Such a command still publishes, carrying the current set's other tables forward where what
    they were computed from is what this config computes them from now; a peer it cannot read
    has no digest to compare, so it is left out of that comparison: a table computed with the
    peer when its file existed is dropped, one computed without it is carried."""
    unmade = {v.name for v in cfg.variants if v.kind == "external" and not v.gguf.exists()}
    if not unmade:
        return cfg
    return replace(cfg, variants=tuple(v for v in cfg.variants if v.name not in unmade),
                   compare=tuple(pair for pair in cfg.compare if not unmade & set(pair)))
