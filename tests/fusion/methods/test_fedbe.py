"""FedBE (fusion/methods/fedbe.py): its distillation on unlabeled data."""

from __future__ import annotations

import torch

from posterior_fusion.fusion import FusionInputs, FusionOptions, fuse


def test_fedbe_distillation_with_unlabeled_data(fitted):
    folder, paths = fitted
    inputs, res, meta = fuse(paths, "fedbe", FusionOptions(progress=False), {"num_samples": 4, "distill_epochs": 5, "sharpen": 1.0},
                             unlabeled_path=folder / "val.h5")
    assert len(res.members) == 1 and meta["distilled_from"] == 1 + 3 + 4
    # The student moved away from the Gaussian mean it started from, towards the teachers.
    from posterior_fusion.fusion.methods.fedbe import FedBESettings, fedbe

    no_distill = fedbe(FusionInputs(inputs.clients, FusionOptions(progress=False)), FedBESettings(num_samples=4))
    assert not torch.allclose(res.members[0], no_distill.members[0])
    from posterior_fusion.models.functional import batched_logits

    x, _ = inputs.unlabeled.tensors()
    teacher = torch.softmax(batched_logits(inputs.spec, torch.stack(no_distill.members), x), -1).mean(0)
    kl = lambda w: (teacher * (teacher.clamp_min(1e-12).log() - torch.log_softmax(batched_logits(inputs.spec, w[None], x)[0], -1))).sum(-1).mean()  # noqa: E731
    assert kl(res.members[0]) < kl(no_distill.members[0])
