"""FedAvg and the Fisher merge by hand."""

from __future__ import annotations

import torch
from conftest import hand_clients

from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
)

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_fedavg_and_fisher_merge_by_hand():
    cl = hand_clients([[0.0, 2.0, 1.0], [4.0, 6.0, 5.0]], [[1.0, 0.0, 0.0], [3.0, 1.0, 0.0]], [1, 3])
    torch.testing.assert_close(fedavg(FusionInputs(cl, FusionOptions())).members[0], torch.tensor([3.0, 5.0, 4.0]))
    # param 0: (1*0 + 3*4)/4 = 3; param 1: only client 1 has curvature -> 6; param 2: no curvature -> FedAvg 4
    res = fisher_merge(FusionInputs(cl, FusionOptions()))
    torch.testing.assert_close(res.members[0], torch.tensor([3.0, 6.0, 4.0]))
    assert res.info["fedavg_fallback_params"] == 1
