"""`fedsplit export` and `fedsplit admin add-site`."""

from __future__ import annotations

import numpy as np
import torch
from fedsplit.cli.app import app as fedsplit_app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import read_weights


def test_export_writes_the_float_parameters(tmp_path, capsys):
    """A state_dict becomes a weight file; BatchNorm's integer counter is skipped and reported."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    out = tmp_path / "site.h5"
    code = run_guarded(
        fedsplit_app, ["export", str(tmp_path / "ckpt.pt"), "--num-examples", "250", "-o", str(out)]
    )
    assert code == 0
    assert "skipped 1 non-float entr(y/ies): 1.num_batches_tracked" in capsys.readouterr().out
    update = read_weights(out)
    assert update.num_examples == 250
    assert list(update.arrays) == [k for k in model.state_dict() if k != "1.num_batches_tracked"]
    np.testing.assert_array_equal(update.arrays["0.weight"], model[0].weight.detach().numpy())


def test_export_refuses_a_non_checkpoint(tmp_path, capsys):
    """A file torch cannot load safely: exit 3 (WeightFileError) and the fix."""
    (tmp_path / "x.pt").write_bytes(b"not a checkpoint")
    code = run_guarded(
        fedsplit_app, ["export", str(tmp_path / "x.pt"), "--num-examples", "5", "-o", str(tmp_path / "o.h5")]
    )
    assert code == 3
    assert "is not a torch file loadable with weights_only=True" in capsys.readouterr().err


def test_add_site_prints_the_token_last_and_refuses_duplicates(tmp_path, capsys):
    """The token is alone on the last line; the same name twice is refused."""
    args = ["admin", "add-site", "hospital-a", "--data-dir", str(tmp_path), "--cohort-size", "900"]
    assert run_guarded(fedsplit_app, args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("fss_") and " " not in lines[-1]
    assert run_guarded(fedsplit_app, args) == 2
    assert capsys.readouterr().err.strip() == (
        "ConfigError: A site called 'hospital-a' already exists in this store; pick another name, or "
        "give it a new token with `fedsplit admin rotate-token`. Received: 'hospital-a'"
    )
