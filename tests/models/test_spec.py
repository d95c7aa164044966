"""Model specs: keyword arguments checked and bounded before anything is built."""

from __future__ import annotations

import pytest
from conftest import child, one_error_line


@pytest.mark.parametrize("kwargs", ['{"in_features": 784, "hidden_sizes": [30000, 30000]}',
                                    '{"in_features": 784, "hidden_sizes": [6000, 6000]}',
                                    '{"in_features": 1000000, "hidden_sizes": [100]}'])
def test_model_kwargs_bombs_are_refused_before_allocation(tmp_path, kwargs, silo_file):
    for cmd in (["init", "--out", tmp_path / "i.h5"], ["fit-local", "--data", silo_file, "--out", tmp_path / "o.h5"]):
        proc, rss = child(*cmd, "--model", "mlp", "--model-kwargs", kwargs, "--max-memory", "256M")
        line = one_error_line(proc)
        assert "parameters" in line and ("over the cap" in line or "over the limit" in line)
        assert rss < 700, rss  # torch's own import; never the model
