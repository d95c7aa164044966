"""``posterior_fusion/fusion/synthesis.py``: the data-free inputs match the clients' recorded K-FAC input factors
(the first layer's pooled, every later layer's under the clients' own networks), and no silo is read."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from conftest import fit_split

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.fusion.synthesis import first_layer, input_second_moment, layer_factors


def _silo_inputs(client, silo, n):
    x = torch.as_tensor(silo.x[:n]).float()[:, None] / 255
    transform = client.metadata.get("input_transform")
    if transform:
        from posterior_fusion.data.transform import InputTransform

        x = InputTransform.from_dict(dict(transform), "x").apply(silo.x[:n], "x")
    return x


def test_data_free_teaching_matches_the_clients_input_moment_and_reads_no_silo(tmp_path, small_silo):
    """``fuse --distill`` without ``--unlabeled`` on kron clients: the synthetic inputs' first-layer second moment
    is within 25% (relative Frobenius) of the clients' pooled K-FAC input factor; the silo files are removed
    before the server step (nothing of them is read); the artifact records the recipe, the teacher's SHA-256 and
    the agreement, and ``inspect`` prints them."""
    paths = fit_split(tmp_path, small_silo, 2, 150, "kron", kwargs={"hidden": 8}, mixtures=1)
    for silo in tmp_path.glob("*silo*"):
        silo.unlink()
    out = tmp_path / "one.h5"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill",
                                   "--distill-steps", "60", "--distill-synth-size", "256", "--distill-synth-steps", "60",
                                   "--distill-input-shape", "1,28,28", "--out", str(out)])
    assert r.exit_code == 0, r.output
    g = posterior_fusion.load(out)
    record = g.metadata["distill"]
    assert len(g.members) == 1 and record["recipe"] == "data-free" and record["file"] is None
    assert record["synthesis"]["moment_mismatch"] <= 0.25, record["synthesis"]
    assert len(record["teacher_sha256"]) == 64 and 0 <= record["agreement"] <= 1
    shown = CliRunner().invoke(pfuse, ["inspect", str(out)])
    assert record["teacher_sha256"] in shown.output and "agreement" in shown.output


def test_the_moment_is_the_kfac_input_factor(small_silo, tmp_path):
    """The synthesis matches against the quantity the artifact holds: the first layer's K-FAC (expand) input factor
    equals :func:`input_second_moment` on the silo's inputs."""
    paths = fit_split(tmp_path, small_silo, 1, 120, "kron", kwargs={"hidden": 8}, mixtures=1)
    client = posterior_fusion.load(paths[0])
    spec = client.model_spec
    x = _silo_inputs(client, small_silo, 120)
    A = client.components[0].curvature.blocks[0].A
    torch.testing.assert_close(input_second_moment(first_layer(spec.build()), x), A.float(), rtol=1e-4, atol=1e-6)




def test_every_later_layers_factor_is_the_second_moment_of_its_inputs_under_the_clients_network(small_silo, tmp_path):
    """:func:`layer_factors` pairs each later layer with the factor the artifact holds for it: under the client's own
    network on its own inputs, each layer's input second moment is that factor (a dense float64 reference)."""
    paths = fit_split(tmp_path, small_silo, 1, 120, "kron", kwargs={"hidden_sizes": [12, 8], "bias": False},
                      mixtures=1)
    client = posterior_fusion.load(paths[0])
    (w, pairs), = layer_factors([client])
    assert [i for i, _ in pairs] == [1, 2]
    net = client.model_spec.build().double().eval()
    torch.nn.utils.vector_to_parameters(w.double(), net.parameters())
    layers = [m for m in net.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    seen = {}
    for i, _ in pairs:
        layers[i].register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0]))
    net(_silo_inputs(client, small_silo, 120).double())
    for i, A in pairs:
        torch.testing.assert_close(input_second_moment(layers[i], seen[i]), A.double(), rtol=1e-3, atol=1e-5)


def test_data_free_inputs_matching_every_layer_record_the_later_layers_mismatch(tmp_path, small_silo):
    paths = fit_split(tmp_path, small_silo, 2, 150, "kron", kwargs={"hidden_sizes": [12, 8], "bias": False},
                      mixtures=1)
    out = {}
    for layers in ("first", "all"):
        out[layers] = tmp_path / f"{layers}.h5"
        r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill",
                                       "--distill-steps", "20", "--distill-synth-size", "128", "--distill-synth-steps",
                                       "80", "--distill-input-shape", "1,28,28", "--distill-moment-layers", layers,
                                       "--out", str(out[layers])])
        assert r.exit_code == 0, r.output
    first = posterior_fusion.load(out["first"]).metadata["distill"]["synthesis"]
    every = posterior_fusion.load(out["all"]).metadata["distill"]["synthesis"]
    assert "later_layers_mismatch" not in first and 0 <= every["later_layers_mismatch"] < 0.5, every


def test_data_free_teaching_refuses_factors_that_are_not_expand_ones(tmp_path, small_silo):
    """A K-FAC ``reduce`` artifact holds another quantity than the inputs' second moment: refused, naming the file."""
    paths = fit_split(tmp_path, small_silo, 2, 100, "kron", kwargs={"hidden": 4}, mixtures=1, kfac="reduce")
    assert posterior_fusion.load(paths[0]).metadata.get("kfac") == "reduce"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--distill",
                                   "--distill-input-shape", "1,28,28", "--out", str(tmp_path / "x.h5")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "post_0.h5" in errors[0] and "reduce" in errors[0], r.output
