"""``posterior_fusion/fusion/teaching.py``: consistent teaching (the teacher on the student's own view, fresh or
from cached views), its augmentations, its mechanics on a single teacher, a student of another model, and the
CLI's one-line refusals."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import fit_split
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData
from posterior_fusion.fusion.distill_settings import TeachingConfig
from posterior_fusion.fusion.synthesis import first_layer
from posterior_fusion.fusion.teaching import augment, cutmix, teach
from posterior_fusion.models import ModelSpec


def _spied_teaching(cfg: TeachingConfig, answer) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """:func:`teach` on 60 random 1×4×4 inputs with a spy teacher (``answer``: batch -> probabilities) and a hook on
    the student: ``(the inputs, what the teacher was asked, what the student trained on)``, in order."""
    spec = ModelSpec("mlp", {"in_features": 16, "hidden": 4, "num_classes": 3})
    torch.manual_seed(0)
    members = parameters_to_vector(spec.build().parameters())[None].detach()
    x = torch.randn(60, 1, 4, 4)
    asked, trained = [], []

    def spy(batch: torch.Tensor) -> torch.Tensor:
        asked.append(batch.clone())
        return answer(batch)

    real_build = ModelSpec.build

    def build(self):
        model = real_build(self)
        model.register_forward_pre_hook(lambda m, args: trained.append(args[0].clone()) if m.training else None)
        return model

    try:
        ModelSpec.build = build
        teach(spec, members, x, cfg, teacher=spy, show_progress=False)
    finally:
        ModelSpec.build = real_build
    return x, asked, trained


def test_the_teacher_sees_exactly_the_students_augmented_batch():
    """A spy teacher records what it is asked about; a hook records what the student trains on: the same tensors,
    step by step, and not the clean inputs (the augmentation moved them)."""
    cfg = TeachingConfig(steps=5, batch_size=8, pad=1, flip="on", mixup=1.0, ema=0.0)
    x, asked, trained = _spied_teaching(cfg, lambda batch: torch.full((batch.shape[0], 3), 1 / 3))
    during = asked[1:]  # the first call: the held-out inputs' labels
    assert len(trained) == len(during) == 5
    assert all(torch.equal(a, b) for a, b in zip(trained, during))
    assert not any(torch.equal(b, x[: len(b)]) for b in during)


def test_cached_views_are_taught_once_each_and_every_batch_is_drawn_from_them():
    """With ``views``: the teacher is asked once per cached view, never during the steps, and every batch the student
    trains on is a set of those views (so the teacher's output is still the one on the student's exact view)."""
    cfg = TeachingConfig(steps=7, batch_size=8, pad=1, flip="on", mixup=1.0, ema=0.0, views=3)
    x, asked, trained = _spied_teaching(cfg, lambda batch: torch.softmax(batch.reshape(batch.shape[0], -1)[:, :3], -1))
    views = torch.cat(asked[1:])  # after the held-out inputs: the cache, 3 views of the 30 training inputs (30 held out)
    assert views.shape[0] == 3 * 30 and len(trained) == 7
    assert not any(torch.equal(v, u) for v in views[:8] for u in x)  # augmented, not the clean inputs
    for batch in trained:
        assert all(bool((views == row).flatten(1).all(1).any()) for row in batch)


def test_augment_shifts_within_the_padding_and_flips_only_when_asked():
    g = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4)
    out = augment(x, TeachingConfig(pad=0, mixup=0.0), False, g, False)
    assert torch.equal(out, x)
    out = augment(x, TeachingConfig(pad=0, mixup=0.0), True, torch.Generator().manual_seed(3), False)
    assert all(torch.equal(o, v) or torch.equal(o, v.flip(-1)) for o, v in zip(out, x))
    out = augment(x, TeachingConfig(pad=1, mixup=0.0), False, g, False)
    assert out.shape == x.shape


def test_cutmix_pastes_one_box_of_another_image_of_the_batch():
    """Each image is itself outside one axis-aligned box and, inside it, another image of the batch; with mixup as
    well, batches take one or the other."""
    torch.manual_seed(0)
    x = torch.randn(16, 2, 9, 9)
    out = cutmix(x, 1.0, torch.Generator().manual_seed(1))
    pasted = 0
    for i in range(16):
        changed = (out[i] != x[i]).any(0)
        if changed.any():
            rows, cols = changed.any(1).nonzero().flatten(), changed.any(0).nonzero().flatten()
            box = (slice(int(rows.min()), int(rows.max()) + 1), slice(int(cols.min()), int(cols.max()) + 1))
            assert any(torch.equal(out[i][:, box[0], box[1]], x[j][:, box[0], box[1]]) for j in range(16) if j != i)
            outside = torch.ones(9, 9, dtype=torch.bool)
            outside[box] = False
            assert torch.equal(out[i][:, outside], x[i][:, outside])
            pasted += 1
    assert pasted >= 8
    both = TeachingConfig(pad=0, mixup=1.0, cutmix=1.0)
    kinds = set()
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        view = augment(x, both, False, g, False)
        kinds.add("cutmix" if bool(((view == x) | (view.unsqueeze(1) == x.unsqueeze(0)).any(1)).all()) else "mixup")
    assert kinds == {"cutmix", "mixup"}


def test_a_student_learns_a_single_teacher_to_99_percent_agreement():
    """The recipe's mechanics: a student of the teacher's own architecture, from scratch at another seed, taught on
    the teacher's inputs, agrees with it on ≥ 99% of held-out inputs."""
    spec = ModelSpec("mlp", {"in_features": 8, "hidden": 16, "num_classes": 4})
    torch.manual_seed(1)
    teacher = parameters_to_vector(spec.build().parameters()).detach()[None]
    x = torch.randn(5000, 8, generator=torch.Generator().manual_seed(2))
    cfg = TeachingConfig(steps=4000, batch_size=128, lr=3e-2, start="scratch", seed=7, temperature=1.0, mixup=0.0,
                         ema=0.99)
    w, record = teach(spec, teacher, x, cfg, show_progress=False)
    assert record["agreement"] >= 0.99 and record["start"] == "scratch"
    assert not torch.equal(w, teacher[0])


def test_a_student_of_another_model_is_taught_and_its_artifact_serves_it(tmp_path, small_silo):
    """``--distill-student``: the one network is of the named model (wider than the clients'), written with its own
    spec and layout; ``evaluate`` and the Python API serve it, its predictions are the student's own; a student that
    does not fit the inputs is refused in one line before any fusion."""
    from posterior_fusion.data.silo import write_silo

    paths = fit_split(tmp_path, small_silo, 2, 100, "diag", kwargs={"hidden": 4}, mixtures=1)
    server = tmp_path / "server.h5"
    write_silo(server, SiloData(small_silo.x[200:300], None, "fmnist", 10))
    test = tmp_path / "test.h5"
    write_silo(test, SiloData(small_silo.x[200:300], small_silo.y[200:300], "fmnist", 10))
    out = tmp_path / "wide.h5"
    wide = '{"name": "mlp", "kwargs": {"hidden": 24}}'
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill", "--unlabeled",
                                   str(server), "--distill-steps", "40", "--distill-student", wide, "--out", str(out)])
    assert r.exit_code == 0, r.output
    g = posterior_fusion.load(out)
    assert g.model_spec.name == "mlp" and g.model_spec.kwargs["hidden"] == 24
    assert len(g.members) == 1 and g.members[0].numel() == g.model_spec.parameter_count()
    assert g.metadata["distill"]["start"] == "scratch" and '"hidden": 24' in g.metadata["distill"]["student"]
    assert first_layer(g.models()[0]).weight.shape == (24, 784)
    r = CliRunner().invoke(pfuse, ["evaluate", str(out), "--data", str(test), "--json"])
    assert r.exit_code == 0 and '"accuracy"' in r.output, r.output
    for student in ('{"name": "lenet", "kwargs": {"in_channels": 3}}', "nosuchnet", '{"name": "lenet"'):
        bad = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill", "--unlabeled",
                                         str(server), "--distill-student", student, "--out", str(tmp_path / "no.h5")])
        assert bad.exit_code == 2 and bad.stderr.count("\n") == 1, bad.output
        assert "distill" not in bad.output.replace(bad.stderr, "") and not (tmp_path / "no.h5").exists()


def test_a_view_cache_over_the_memory_limit_is_refused_before_any_teaching(tmp_path, small_silo):
    from posterior_fusion.data.silo import write_silo

    paths = fit_split(tmp_path, small_silo, 2, 100, "diag", kwargs={"hidden": 4}, mixtures=1)
    write_silo(tmp_path / "server.h5", SiloData(small_silo.x[200:300], None, "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill", "--unlabeled",
                                   str(tmp_path / "server.h5"), "--distill-views", "5000", "--max-memory", "200M",
                                   "--out", str(tmp_path / "x.h5")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "--distill-views" in errors[0], r.output
    assert "fusing" not in r.output and not (tmp_path / "x.h5").exists()  # refused before the fusion


@pytest.mark.parametrize("args, words", [(["--distill-steps", "0"], "steps"), (["--distill-flip", "maybe"], "flip"),
                                         (["--distill-lr", "fast"], "lr"), (["--distill-input-shape", "a,b"], "input_shape")])
def test_the_recipes_settings_refuse_bad_values_in_one_line(tmp_path, small_silo, args, words):
    paths = fit_split(tmp_path, small_silo, 2, 100, "diag", kwargs={"hidden": 4}, mixtures=1)
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill", *args,
                                   "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and words in r.stderr.replace("-", "_"), r.output
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill-steps", "5",
                                   "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and "--distill" in r.stderr


