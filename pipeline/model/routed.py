"""The routed experts' output over a layer's dump rows, with the routing the dump recorded.

What calibrate fits alpha against and what the sensitivity measure scores a candidate format by: one
small module of its own, so that neither stage's code identity holds the other's (an edit to
calibrate's healing must not re-measure every budget's sensitivity).
"""

from __future__ import annotations

import jax
import numpy as np

from moeheal.pipeline.model.layers import moe_forward


def routed_output(experts_f32: dict[str, jax.Array], data: dict[str, np.ndarray]) -> np.ndarray:
    """The routed experts' output (T, d) for a group's rows, with the dump's routing: what alpha and
    the sensitivity measure compare against the reference's."""
    return np.asarray(moe_forward(
        {"gate_exps": experts_f32["ffn_gate_exps"], "up_exps": experts_f32["ffn_up_exps"],
         "down_exps": experts_f32["ffn_down_exps"]},
        data["mixed"], data["experts"], data["weights"]))  # (T, d)
