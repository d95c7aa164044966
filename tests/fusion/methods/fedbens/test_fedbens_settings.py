"""FedBEns' settings and the rule resolving their auto values (fusion/methods/fedbens/fedbens_settings.py)."""

from __future__ import annotations

import pytest
import torch

import posterior_fusion
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionOptions,
    fuse,
)
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_fedbens_default_is_the_validation_free_fusion_without_validation_data(fitted):
    """``solver=auto`` (the default): without validation data fedbens runs EM with the prior centre at the
    clients and the server prior from the evidence — the same modes as those settings given explicitly — and
    says so in ``resolved``; with validation data it runs the paper's Adam (the same modes as solver=adam);
    an explicit ``solver=em`` keeps the paper's zero centre and the clients' λ0. Adam without validation data
    (only when asked for) warns once, naming the default."""
    import warnings

    from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, resolve_auto

    folder, paths = fitted
    opts = FusionOptions(progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, auto, auto_meta = fuse(paths, "fedbens", opts, {"steps": 40, "laplace": False})
    assert not [w for w in caught if "without validation data" in str(w.message)]
    assert auto_meta["resolved"] == {"solver": "em", "prior_centre": "clients", "server_prior": "evidence"}
    assert auto_meta["settings"]["solver"] == "auto"  # what was asked, beside what ran
    assert "server_prior_search" in auto_meta
    _, explicit, _ = fuse(paths, "fedbens", opts, {"steps": 40, "laplace": False, "solver": "em",
                                             "prior_centre": "clients", "server_prior": "evidence"})
    for a, b in zip(auto.members, explicit.members):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    val = folder / "val.h5"
    _, with_val, val_meta = fuse(paths, "fedbens", opts, {"steps": 6, "val_every": 2, "laplace": False}, val_path=val)
    _, adam, _ = fuse(paths, "fedbens", opts, {"steps": 6, "val_every": 2, "laplace": False, "solver": "adam"},
                val_path=val)
    assert val_meta["resolved"] == {"solver": "adam", "prior_centre": "prior", "server_prior": "clients"}
    for a, b in zip(with_val.members, adam.members):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # EM where asked for, with or without validation: explicit solver=em keeps the paper's centre and λ0
    assert resolve_auto(FedBEnsSettings(solver="em"), False).prior_centre == "prior"
    assert resolve_auto(FedBEnsSettings(solver="em"), False).server_prior == "clients"
    assert resolve_auto(FedBEnsSettings(server_prior="evidence"), True).solver == "em"
    assert resolve_auto(FedBEnsSettings(trust_radius=0.1), True).solver == "em"
    assert resolve_auto(FedBEnsSettings(prior_centre="prior"), False).prior_centre == "prior"  # explicit wins
    # diagonal curvature: the stationary point predicts far worse than Adam's early iterates (measured), so
    # auto stays the paper's Adam there, without a warning
    for structure in ("diag", "diag+full"):
        assert resolve_auto(FedBEnsSettings(), False, structure).solver == "adam"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, diag_meta = fuse([folder / "diag_0.h5"], "fedbens", opts, {"steps": 2, "laplace": False})
    assert diag_meta["resolved"]["solver"] == "adam"
    assert not [w for w in caught if "without validation data" in str(w.message)]
    with pytest.raises(posterior_fusion.errors.ConfigError, match="server_prior=evidence needs solver=em"):
        FedBEnsSettings.from_mapping({"solver": "adam", "server_prior": "evidence"}, "fedbens")
    with pytest.warns(UserWarning, match="solver=auto"):
        fuse(paths, "fedbens", opts, {"steps": 2, "laplace": False, "solver": "adam"})


def test_server_prior_settings_are_checked():
    for bad, match in [(dict(server_prior="evidence", solver="adam"), "needs solver=em"),
                       (dict(server_prior="validation", solver="em"), "server_prior must be one of")]:
        with pytest.raises(posterior_fusion.errors.ConfigError, match=match):
            FedBEnsSettings(**bad).validate()
