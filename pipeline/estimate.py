"""How long a heal will take, before it runs: `moeheal plan --estimate`.

A per-unit cost model. Every stage invocation a heal would compute (the plan's
`compute` entries, one per fingerprint: two variants with the same knobs share
their units) is one `Invocation`: its cost-model key (the stage's name;
quantize with its rounding, `quantize:gptq`, whose cost differs by an order of
magnitude between roundings; a tuned unit or e2e step over codebook i-quants with
`:codebook`, each 3x its k-quant's at the 30B shape), the weights it reads or writes (`size`) and the
weights times tokens it computes over (`work`), from the model's shapes (the
GGUF header) and the tokens the stage's knobs name. A stage kind costs

    once + per_size x size + per_work x work        (seconds; sizes in 1e9 weights, work in 1e12)

summed over its invocations, `once` paid once per heal that builds the kind
(compiling its programs). The three constants per key and device class are
fitted to committed timing records by bench/tools/fit_cost_model.py and kept in
`moeheal/data/cost_model.json` with the records they came from. Nothing here
runs a stage or reads more than the plan and the windows file.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Iterable

from moeheal.kernels.decode import format_of
from moeheal.kernels.iquants import IQuant
from moeheal.pipeline.errors import InputError

DEVICES = ("h200", "h100", "cpu")
SIZE_UNIT, WORK_UNIT = 1e9, 1e12  # the constants' scale: seconds per 1e9 weights, per 1e12 weight-tokens
COST_MODEL = "cost_model.json"
CODEBOOK = "codebook"  # the keys' suffix of units and steps over codebook i-quants
LONG_HEAL_S = 600.0  # `moeheal heal` prints its estimate first beyond this

# Stages that run once per MoE layer (quantize, calibrate and healed-dump units), those that run the whole
# model forward over tokens, and those whose time does not depend on the model (size 0, work 0: `once`).
PER_LAYER = ("quantize", "calibrate", "healed-dump")
FORWARD = ("reference-topk", "guidance", "e2e", "reference-logits", "evaluate")


@dataclass(frozen=True)
class Shapes:
    """What the cost depends on in a model: from its GGUF header (`shapes_of`) or a synthetic one's."""

    n_moe: int  # MoE layers
    n_expert: int
    n_expert_used: int
    d_model: int
    d_expert: int  # one routed expert's FFN width
    vocab: int

    @property
    def routed(self) -> float:
        """Routed-expert weights of one MoE layer (gate, up, down)."""
        return 3.0 * self.n_expert * self.d_model * self.d_expert

    @property
    def active(self) -> float:
        """Routed-expert weights one token passes through in one MoE layer."""
        return 3.0 * self.n_expert_used * self.d_model * self.d_expert

    @property
    def forward(self) -> float:
        """Weights one token of a whole forward pass multiplies by: the experts it is routed to, the logits."""
        return self.n_moe * self.active + self.vocab * self.d_model


def shapes_of(model: Any) -> Shapes:
    """A `GGUFModel`'s shapes (its header's hyperparameters and MoE layers)."""
    hp = model.hp
    return Shapes(len(model.moe_layers), hp.n_expert, hp.n_expert_used, hp.d_model, hp.d_expert, hp.vocab_size)


@dataclass(frozen=True)
class Invocation:
    """One stage invocation as the cost model sees it."""

    key: str  # "quantize:gptq", "calibrate", "dump", ...
    size: float  # weights read or written
    work: float  # weights x tokens computed over


def codebook(formats: Iterable[str]) -> bool:
    """Whether any of these formats is a codebook i-quant: at the 30B shape their GPTQ and learned units
    cost about 2.8x a k-quant's and their e2e steps 3.3x (bench/RESULTS.md, "The recipe at 2 and 3
    layers"), so their units are priced apart. A budget variant counts its candidates."""
    return any(issubclass(format_of(f), IQuant) for f in formats)


def rounding_key(round_: str, importance: bool, over_codebook: bool = False) -> str:
    """Quantize's cost-model key: its rounding; `rtn` for the baseline (no statistics, no dump read);
    GPTQ and learned rounding over codebook formats apart (`codebook`)."""
    key = f"quantize:{round_ if importance or round_ != 'ls' else 'rtn'}"
    return f"{key}:{CODEBOOK}" if over_codebook and round_ in ("gptq", "learned") else key


def e2e_key(over_codebook: bool) -> str:
    """e2e's cost-model key: a step over codebook formats apart (`codebook`)."""
    return f"e2e:{CODEBOOK}" if over_codebook else "e2e"


def invocation(key: str, shapes: Shapes, tokens: int = 0, formats: int = 1, layers: int | None = None) -> Invocation:
    """The size and work of one invocation of `key` over `tokens` (its calibration rows, its trace, e2e's
    steps x sequence tokens, or the evaluated tokens; `formats`: a sensitivity measurement's candidates,
    over `layers` of the model's MoE layers: a unit's one, or all of them, as records made before the
    measurement ran per layer timed it)."""
    stage = key.split(":")[0]
    if stage in PER_LAYER:
        return Invocation(key, shapes.routed, 0.0 if key == "quantize:rtn" else tokens * shapes.active)
    if stage == "dump":
        return Invocation(key, shapes.n_moe * shapes.routed, tokens * shapes.n_moe * shapes.active)
    if stage in FORWARD:
        return Invocation(key, shapes.n_moe * shapes.routed, tokens * shapes.forward)
    if stage == "sensitivity":
        n = shapes.n_moe if layers is None else layers
        return Invocation(key, formats * n * shapes.routed, formats * tokens * n * shapes.active)
    if stage in ("assemble", "llama-check", "llama-reference"):
        return Invocation(key, shapes.n_moe * shapes.routed, 0.0)
    return Invocation(key, 0.0, 0.0)


def base_key(key: str) -> str:
    """A codebook key's k-quant key (`quantize:learned:codebook` -> `quantize:learned`); any other key itself."""
    return key.removesuffix(f":{CODEBOOK}")


def seconds(invocations: list[Invocation], constants: dict[str, list[float]]) -> dict[str, float | None]:
    """Predicted seconds per key: `once` plus the rates times the summed size and work; None for a key
    the constants have no record of. A codebook key without constants of its own (its class's records
    could not tell it from its base key) is priced, and named, as its base key."""
    totals: dict[str, tuple[float, float]] = {}
    for inv in invocations:
        key = inv.key if inv.key in constants else base_key(inv.key)
        size, work = totals.get(key, (0.0, 0.0))
        totals[key] = (size + inv.size, work + inv.work)
    return {key: None if key not in constants else
            constants[key][0] + constants[key][1] * size / SIZE_UNIT + constants[key][2] * work / WORK_UNIT
            for key, (size, work) in totals.items()}


def load_cost_model() -> dict[str, Any]:
    """The fitted constants shipped with the package (bench/tools/fit_cost_model.py writes them)."""
    return json.loads((files("moeheal") / "data" / COST_MODEL).read_text("utf-8"))


def device_constants(model: dict[str, Any], device: str) -> dict[str, list[float]]:
    """One device class's constants; InputError (one line, exit 2) for a class it has no records of."""
    if device not in DEVICES:
        raise InputError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if device not in model["devices"]:
        raise InputError(f"--device {device}: the cost model has no timing records of it (fitted for "
                         f"{', '.join(sorted(model['devices']))}: bench/tools/fit_cost_model.py)")
    return model["devices"][device]["constants"]


def default_device() -> str:
    """The device class of what JAX sees: an H200, an H100 or the CPU."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.upper()
    for name in ("h200", "h100"):
        if name.upper() in kind:
            return name
    raise InputError(f"JAX sees {device.device_kind}, which the cost model has no class for: "
                     f"name one with --device ({', '.join(DEVICES)})")


# ---- the plan's invocations --------------------------------------------------------------------
def eval_tokens(cfg: Any) -> int:
    """Tokens one evaluation runs the model over: every window's context and scored span."""
    if cfg.windows is not None:
        with open(cfg.windows, newline="", encoding="utf-8") as f:
            return sum(int(r["ctx_tokens"]) + int(r["scored_tokens"]) for r in csv.DictReader(f))
    gen = cfg.window_generation
    return (gen.eval_per_stratum + gen.canary_per_stratum) * len(cfg.mix) * (gen.ctx_tokens + gen.scored_tokens)


def node_invocation(name: str, params: Any, cfg: Any, shapes: Shapes, variant: Any = None) -> Invocation:
    """The invocation of one planned node of stage `name` with its parameters object (and the variant its
    label names, where it names one: a budget unit's or an e2e step's formats are its candidates)."""
    trace_tokens = {"calibration": cfg.cal_tokens, "unseen": cfg.unseen_tokens}
    rows = getattr(params, "cal_tokens", None) or cfg.cal_tokens  # a unit's rows: 0 or None is the whole dump
    formats = variant.candidate_formats() if variant is not None else ()
    if name == "quantize":
        over_codebook = codebook(params.quant.values() if params.quant else formats)
        return invocation(rounding_key(params.round, params.importance, over_codebook), shapes, rows)
    if name in ("calibrate", "healed-dump"):
        return invocation(name, shapes, rows)
    if name == "dump":
        return invocation(name, shapes, trace_tokens[params.trace])
    if name == "import-dump":
        return invocation(name, shapes)
    if name == "reference-topk":
        return invocation(name, shapes, sum(trace_tokens[t] for t in params.traces))
    if name == "guidance":
        return invocation(name, shapes, trace_tokens[params.trace])
    if name == "e2e":
        return invocation(e2e_key(codebook(formats)), shapes, params.steps * params.seq_tokens * (params.batch_seqs or 1))
    if name == "reference-logits":
        return invocation(name, shapes, eval_tokens(cfg))
    if name == "evaluate":
        return invocation(name, shapes, eval_tokens(cfg) * params.reps * max(1, len(params.bonus)))
    if name == "sensitivity":  # one layer's unit
        return invocation(name, shapes, cfg.unseen_tokens, formats=len(params.formats), layers=1)
    return invocation(name, shapes)


def plan_invocations(run: Any) -> list[Invocation]:
    """What a planned `HealRun` would compute: each `compute` entry of its plan once per fingerprint."""
    planned = run.plan()
    nodes = {node.label: node for node in run.executor.nodes}  # every node the plan reached, by label
    shapes, seen, out = shapes_of(run.source), set(), []
    variants = {v.name: v for v in run.cfg.variants}  # a node's label names its variant second: quantize:<v>:<layer>
    for p in planned:
        if p.status != "compute" or p.fingerprint in seen:
            continue
        seen.add(p.fingerprint)
        named = p.stage.split(":")[1] if ":" in p.stage else ""
        out.append(node_invocation(p.name, nodes[p.stage].params, run.cfg, shapes, variants.get(named)))
    return out


def estimate_table(predicted: dict[str, float | None], device: str) -> str:
    """The estimate as a short table: each key's minutes, longest first, and the total."""
    known = {k: s for k, s in predicted.items() if s is not None}
    unknown = sorted(k for k, s in predicted.items() if s is None)
    width = max(map(len, [*predicted, "total"]))
    lines = [f"estimated wall time on {device} (bench/tools/fit_cost_model.py):"]
    lines += [f"  {k:<{width}}  {s / 60:8.1f} min" for k, s in sorted(known.items(), key=lambda kv: -kv[1])]
    lines.append(f"  {'total':<{width}}  {sum(known.values()) / 60:8.1f} min"
                 + (f"  (without {', '.join(unknown)}: no record of it on {device})" if unknown else ""))
    return "\n".join(lines)


def total_s(predicted: dict[str, float | None]) -> float:
    return sum(s for s in predicted.values() if s is not None)


def long_heal_note(run: Any) -> str:
    """What `moeheal heal` prints first: the estimate of a planned `HealRun` where it passes LONG_HEAL_S on
    the device class JAX sees, else "" (also where that class is unknown or has no record: a forecast
    never stops a heal)."""
    try:
        device = default_device()
        constants = device_constants(load_cost_model(), device)
    except InputError:
        return ""
    predicted = seconds(plan_invocations(run), constants)
    return estimate_table(predicted, device) if total_s(predicted) > LONG_HEAL_S else ""
