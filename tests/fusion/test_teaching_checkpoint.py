"""``posterior_fusion/fusion/teaching_checkpoint.py``: a distillation interrupted mid-schedule resumes from its
checkpoint to exactly the result of the run that was never interrupted (mixup and the EMA in play); a
checkpoint of another run is not resumed; a data-free run keeps its synthetic inputs and does not synthesise them
again; ``fuse --distill`` resumes from ``OUT.distill-partial`` and removes it once OUT is written."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import fit_split
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.fusion import teaching
from posterior_fusion.fusion.distill_settings import TeachingConfig
from posterior_fusion.fusion.teaching import teach
from posterior_fusion.models import ModelSpec

SPEC = ModelSpec("mlp", {"in_features": 8, "hidden_sizes": [16, 16], "num_classes": 3})


class Interrupt(Exception):
    pass


def stop_at(step: int):
    """A log callback that interrupts the run when the schedule reaches ``step`` (as a kill would)."""
    def log(message: str) -> None:
        if message.startswith(f"distill: step {step}/"):
            raise Interrupt
    return log


@pytest.fixture
def teachers():
    torch.manual_seed(0)
    members = torch.stack([parameters_to_vector(SPEC.build().parameters()).detach() for _ in range(3)])
    x = torch.randn(300, 8, generator=torch.Generator().manual_seed(1))
    return members, x


def test_an_interrupted_distillation_resumes_to_the_same_result(tmp_path, teachers):
    members, x = teachers
    cfg = TeachingConfig(steps=40, batch_size=16, mixup=1.0, ema=0.9, seed=3)
    whole, record = teach(SPEC, members, x, cfg, show_progress=False)
    ck = tmp_path / "run.distill-partial"
    with pytest.raises(Interrupt):
        teach(SPEC, members, x, cfg, show_progress=False, checkpoint=ck, log=stop_at(28))
    assert ck.is_file()  # the state after step 24, the last tenth reached
    said = []
    resumed, again = teach(SPEC, members, x, cfg, show_progress=False, checkpoint=ck, log=said.append)
    assert any("resuming at step 24 of 40" in m for m in said)
    assert torch.equal(resumed, whole)
    assert again["history"] == record["history"] and again["agreement"] == record["agreement"]


def test_an_interrupted_distillation_from_cached_views_resumes_to_the_same_result(tmp_path, teachers):
    members, x = teachers
    cfg = TeachingConfig(steps=30, batch_size=16, mixup=1.0, ema=0.9, seed=5, views=2)
    whole, _ = teach(SPEC, members, x, cfg, show_progress=False)
    ck = tmp_path / "views.distill-partial"
    with pytest.raises(Interrupt):
        teach(SPEC, members, x, cfg, show_progress=False, checkpoint=ck, log=stop_at(21))
    resumed, _ = teach(SPEC, members, x, cfg, show_progress=False, checkpoint=ck)
    assert torch.equal(resumed, whole)
    fresh, _ = teach(SPEC, members, x, TeachingConfig(steps=30, batch_size=16, mixup=1.0, ema=0.9, seed=5),
                     show_progress=False)
    assert not torch.equal(fresh, whole)  # the cache changes what is taught


def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path, teachers):
    members, x = teachers
    ck = tmp_path / "run.distill-partial"
    with pytest.raises(Interrupt):
        teach(SPEC, members, x, TeachingConfig(steps=20, batch_size=16, seed=3), show_progress=False, checkpoint=ck,
              log=stop_at(16))
    other = TeachingConfig(steps=20, batch_size=16, seed=4)
    said = []
    w, _ = teach(SPEC, members, x, other, show_progress=False, checkpoint=ck, log=said.append)
    assert not any("resuming" in m for m in said)
    assert torch.equal(w, teach(SPEC, members, x, other, show_progress=False)[0])
    for changed in (members + 1e-3, members):  # other teachers; other inputs
        xs = x if changed is not members else x + 1e-3
        said.clear()
        with pytest.raises(Interrupt):
            teach(SPEC, changed, xs, other, show_progress=False, checkpoint=ck, log=lambda m: (said.append(m),
                                                                                              stop_at(4)(m)))
        assert not any("resuming" in m for m in said)


def test_fuse_distill_data_free_resumes_without_synthesising_again(tmp_path, small_silo, monkeypatch):
    paths = fit_split(tmp_path, small_silo, 2, 150, "kron", kwargs={"hidden": 8}, mixtures=1)
    args = ["fuse", *map(str, paths), "--method", "ensemble", "--distill", "--distill-steps", "30",
            "--distill-synth-size", "64", "--distill-synth-steps", "10", "--distill-input-shape", "1,28,28"]
    r = CliRunner().invoke(pfuse, [*args, "--out", str(tmp_path / "whole.h5")])
    assert r.exit_code == 0, r.output
    out = tmp_path / "one.h5"
    real_teach = teaching.teach

    def interrupted(*a, **k):
        return real_teach(*a, **{**k, "log": stop_at(21)})

    monkeypatch.setattr(teaching, "teach", interrupted)
    with pytest.raises(Interrupt):
        CliRunner().invoke(pfuse, [*args, "--out", str(out)], catch_exceptions=False)
    partial = tmp_path / "one.h5.distill-partial"
    assert partial.is_file() and not out.exists()
    monkeypatch.setattr(teaching, "teach", real_teach)
    monkeypatch.setattr(teaching, "synthesise", lambda *a, **k: pytest.fail("synthesised again"))
    r = CliRunner().invoke(pfuse, [*args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "resuming at step 18 of 30" in r.stderr and not partial.exists()
    a, b = posterior_fusion.load(tmp_path / "whole.h5"), posterior_fusion.load(out)
    assert torch.equal(a.members[0], b.members[0])
    assert a.metadata["distill"]["synthesis"] == b.metadata["distill"]["synthesis"]
    assert a.metadata["distill"]["agreement"] == b.metadata["distill"]["agreement"]
