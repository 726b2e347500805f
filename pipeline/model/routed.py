"""The routed experts' output over a layer's dump rows, with the routing the dump recorded.

What calibrate fits alpha against and what the sensitivity measure scores a candidate format by: one
small module of its own, so that neither stage's code identity holds the other's (an edit to
calibrate's healing must not re-measure every budget's sensitivity).
"""

from __future__ import annotations

import jax
from numpy.typing import ArrayLike

from moeheal.pipeline.model.layers import moe_output


ROUTED_INPUTS = ("mixed", "experts", "weights", "yr")  # a dump's rows the routed output and its error read


def routed_inputs_on_device(rows: dict[str, ArrayLike]) -> dict[str, jax.Array]:
    """A group's routed inputs and reference output copied to the device once, where every candidate's
    routed forward and the sums of its error run (0.5 GB each at a real layer's 65,536 rows)."""
    return {name: jax.device_put(rows[name]) for name in ROUTED_INPUTS}


def routed_output(experts_f32: dict[str, jax.Array], data: dict[str, ArrayLike]) -> jax.Array:
    """The routed experts' output (T, d) for a group's rows, with the dump's routing: what alpha and
    the sensitivity measure compare against the reference's. It stays on the device, where the
    comparison's sums run (`kernels.alpha.output_gram`); a real layer's is 0.5 GB. Never differentiated:
    an accelerator runs it in groups of expert blocks (`layers.moe_output`)."""
    return moe_output(
        {"gate_exps": experts_f32["ffn_gate_exps"], "up_exps": experts_f32["ffn_up_exps"],
         "down_exps": experts_f32["ffn_down_exps"]},
        data["mixed"], data["experts"], data["weights"])  # (T, d)
