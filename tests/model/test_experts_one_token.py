"""model/layers.py Experts: a single token (a decode step at batch 1) runs its k experts one after
another instead of grouping tokens by expert; the two paths agree in float64 to the last few bits
(the same products, summed in the same ascending expert order; only the BLAS kernel of a 1-row and
a 2-row product may round differently)."""

from __future__ import annotations

import torch

from pdserve.model.layers import Experts


def test_one_token_path_equals_grouped_path():
    g = torch.Generator().manual_seed(0)
    experts = Experts(8, 24, 16).double()
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g, dtype=torch.float64))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g, dtype=torch.float64))
    x = torch.randn(3, 24, generator=g, dtype=torch.float64)
    ids = torch.tensor([[5, 1, 6], [0, 7, 2], [3, 4, 1]])  # unsorted, as the router returns them
    weights = torch.rand(3, 3, generator=g)  # float32, like the router's island
    grouped = experts(x, weights, ids)  # three tokens: grouped by expert
    for t in range(3):
        one = experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1])
        assert one.dtype == torch.float64 and one.shape == (1, 24)
        torch.testing.assert_close(one[0], grouped[t], rtol=1e-13, atol=1e-12)
