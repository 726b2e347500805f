"""What an output error costs the model's prediction, to second order, by the reference's Fisher.

KL(reference || perturbed) at an output perturbation dz is (1/2) dz^T F dz to second order, F the
Fisher information of the reference's predictive distribution with respect to that output. With F's
diagonal per token and channel (the guidance stage's one-draw estimate), an error's cost is a
weighted sum of its squares: what the sensitivity stage prices each (tensor, format) by, so that
errors of different layers add up on the model's scale rather than each layer's own.

A pure function of arrays: no files, no config.
"""

from __future__ import annotations

import numpy as np


def kl_estimate(fisher: np.ndarray, delta: np.ndarray) -> float:
    """(1/2) sum_tc F_tc delta_tc^2 / T: the mean KL per token an output error `delta` (T, d) costs to
    second order, by the diagonal Fisher `fisher` (T, d) of the same tokens."""
    assert fisher.shape == delta.shape, (fisher.shape, delta.shape)
    return float(0.5 * np.sum(fisher * np.square(delta), dtype=np.float64) / max(1, len(delta)))
