"""What a config asks of its models, checked before any stage runs.

A stage would find most of these problems too, but late (after the corpus,
the dumps, or a long quantization) and in the middle of a run; here each is
one clear line naming the config and the knob, and nothing is computed.
Also the two facts of a variant's recipe the DAG and these checks share: the
roles whose formats it chooses, and the bytes its budget counts beyond them.
"""

from __future__ import annotations

from moeheal.kernels.decode import format_of
from moeheal.pipeline.model import roles
from moeheal.pipeline.config import Config, Variant
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.sizes import fixed_size, least_bpw
from moeheal.pipeline.gguf.tokenizer import build_tokenizer


def chosen_roles(variant: Variant, source: GGUFModel) -> tuple[str, ...]:
    """The roles whose formats the variant sets: a budget's chosen roles, else the routed ones."""
    return roles.chosen_roles(variant.budget_roles, source.arch) if variant.budgeted else roles.ROUTED


def budget_fixed(variant: Variant, source: GGUFModel) -> tuple[int, int]:
    """(weights, bytes) the budget counts beyond the tensors it chooses: none for "routed"; for
    "all", every other tensor (embeddings, output, norms, routers) as the assembled GGUF holds it."""
    if variant.budget_roles == "routed":
        return 0, 0
    return fixed_size(source, chosen_roles(variant, source),
                                  variant.shexp_down if source.arch.has_shared_expert else None)


def validate_models(cfg: Config, reference: GGUFModel, source: GGUFModel) -> None:
    """Open every GGUF the config names (header, tensor table, tokenizer) and check each variant's
    formats and budget against the source's shapes."""
    build_tokenizer(reference)
    ref_hp, src_hp = reference.hp, source.hp
    if (src_hp.n_layer, src_hp.n_expert, src_hp.d_model) != (ref_hp.n_layer, ref_hp.n_expert, ref_hp.d_model):
        raise InputError(f"{cfg.source}: [model] source: {src_hp.n_layer} layers x {src_hp.n_expert} "
                         f"experts x d={src_hp.d_model} does not match the reference's {ref_hp.n_layer} x "
                         f"{ref_hp.n_expert} x d={ref_hp.d_model}")
    arch = reference.arch
    if not arch.supports_moce and any(b != 0 for b in cfg.moce_bonus):
        raise InputError(f"{cfg.path}: [moce] bonus: cache-aware routing is not supported for the {arch} "
                         f"family (its routing is not softmax top-k of the router logits); use bonus = [0.0]")
    for variant in cfg.variants:  # an outside GGUF is absent only where the config allowed it
        if variant.kind == "external" and variant.gguf.exists():
            open_model(variant.gguf)
    for variant in cfg.healed_variants:
        if variant.budgeted and variant.budget_roles == "all" and not source.arch.standard_attention:
            raise InputError(f"{cfg.path}: [[variant]] {variant.name}: budget_roles = \"all\" is not "
                             f"supported for the {source.arch} family (its attention is not the "
                             "standard attention the attention roles measure); use \"routed\"")
        chosen = chosen_roles(variant, source)
        pairs = [(t, f) for f in variant.candidate_formats() for t in chosen]
        if source.arch.has_shared_expert and "ffn_down_shexp" not in chosen:
            pairs.append(("ffn_down_shexp", variant.shexp_down))
        for tensor, fmt in pairs:
            block, columns = format_of(fmt).block_size, roles.input_columns(tensor, src_hp)
            if columns % block:
                raise InputError(f"{cfg.path}: [[variant]] {variant.name}: {fmt} needs rows that are "
                                 f"a multiple of {block} weights; {tensor} rows have {columns}")
        if variant.budgeted:
            least = least_bpw(source, variant.candidates, chosen, budget_fixed(variant, source))
            if variant.budget_bpw < least:
                raise InputError(f"{cfg.path}: [[variant]] {variant.name}: budget_bpw {variant.budget_bpw:g} "
                                 f"is infeasible: with budget_roles = {variant.budget_roles!r} the cheapest recipe "
                                 f"of its formats takes {least:.4f} bits per weight")
