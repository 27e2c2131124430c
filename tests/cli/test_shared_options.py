"""Every data option exists wherever data is read, from one definition (cli/options.py), and
``fedsplit up --site`` hands it to the hospitals' reading (issue 42, item 4)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import get_type_hints

import click
import pytest
from fedsplit.cli import options
from fedsplit.cli.app import load_command
from fedsplit.cli.cox import cox
from fedsplit.cli.km import km
from fedsplit.cli.simulate import simulate
from fedsplit.cli.up import up
from fedsplit.cli.vertical import compare_fills
from fedsplit.cli.vertical import simulate as vertical_simulate
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.site import load_site, site_columns
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import HospitalFailure

from tests.deploy.test_up_own_files import Recording, recording, up_cli  # noqa: F401 (fixture)


def described(command: click.Command) -> dict[str, tuple]:
    """Each option of a click command: its flags, help, default, type and repeatability."""
    return {p.name: (tuple(p.opts), tuple(p.secondary_opts), getattr(p, "help", None), p.default,
                     repr(p.type), p.multiple)
            for p in command.params if isinstance(p, click.Option)}


def test_up_takes_every_data_option_simulate_takes_from_the_same_definition() -> None:
    sim, up_ = described(load_command("simulate")), described(load_command("up"))
    data = [f.name for f in dataclasses.fields(options.DataOptions)]
    assert {"target", "na_values", "ignore_column", "id_column", "time", "event"} <= set(data)
    for name in data:
        assert name in sim and name in up_, name
        assert sim[name] == up_[name], name
    # every option of every group both commands take reads the same on both (defaults may differ:
    # up runs 3 rounds by default)
    for group in options.GROUPS:
        for f in dataclasses.fields(group):
            assert sim[f.name][:3] == up_[f.name][:3] and sim[f.name][4:] == up_[f.name][4:], f.name
    # one definition, not two equal ones: the same typer option object behind every command
    sim_sig, up_sig = inspect.signature(simulate).parameters, inspect.signature(up).parameters
    for name, definition in get_type_hints(options.DataOptions, include_extras=True).items():
        assert sim_sig[name].annotation is up_sig[name].annotation is definition, name
    # the survival commands take the table options they read with from the same definitions,
    # the vertical ones the run options they share
    for command, names in ((km, ("time", "event", "na_values")),
                           (cox, ("time", "event", "id_column", "ignore_column", "na_values",
                                  "min_category_count")),
                           (vertical_simulate, ("rounds", "seed", "lr")),
                           (compare_fills, ("rounds", "seed"))):
        hints = get_type_hints(command, include_extras=True)
        for name in names:
            assert hints[name] is sim_sig[name].annotation, (command.__name__, name)


def test_a_group_option_named_twice_is_refused() -> None:
    def twice(target: str = "", data: options.DataOptions = options.DataOptions()) -> None:
        """Two options named target."""

    with pytest.raises(TypeError, match=r"an option is named twice: \['target'\]"):
        options.grouped(twice)


def hospital_table(path: Path, seed: int) -> Path:
    """30 patients: age, cholesterol (``unknown`` when not measured), a free-text note and the
    diagnosis (0/1), no column named ``target``."""
    lines = ["age,chol,note,diagnosis"]
    for i in range(30):
        chol = "unknown" if i % 7 == 3 else str(180 + (i * 13 + seed) % 90)
        lines.append(f"{40 + (i * 3 + seed) % 40},{chol},visit {i} by dr {seed}-{i},{i % 2}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_up_site_options_reach_the_hospitals_reading(
        tmp_path: Path, recording: type[Recording],  # noqa: F811 (the imported fixture)
        capsys: pytest.CaptureFixture[str]) -> None:
    east, west = hospital_table(tmp_path / "east.csv", 1), hospital_table(tmp_path / "west.csv", 2)
    sites = ["--site", f"east={east}", "--site", f"west={west}"]
    # without --target the pre-start read (the hospitals' own code) names the missing column
    assert up_cli(tmp_path, *sites) == HospitalFailure.exit_code
    err = capsys.readouterr().err
    assert "has no target column 'target'" in err and "--target of simulate, up" in err, err
    assert recording.made == []

    code = up_cli(tmp_path, *sites, "--target", "diagnosis", "--na-values", "chol=unknown",
                  "--ignore-column", "note")
    assert code == 0, capsys.readouterr()
    (federation,) = recording.made
    # the run config as each hospital's ClientApp receives it (Flower's flat run config)
    cfg = RunConfig.from_flower(federation.cfg.to_flower())
    assert (cfg.target, cfg.na_values, cfg.ignore_columns) == ("diagnosis", "chol=unknown", "note")
    for site in federation.sites:
        node = NodeConfig(data_path=str(site.data), site_name=site.name)
        report = site_columns(node, 0, cfg)  # the hospital's reply to the schema exchange
        assert [c.name for c in report.columns] == ["age", "chol"], report
        chol = report.columns[1]
        assert chol.kind == "numeric" and chol.missing > 0, chol  # "unknown" read as missing
        assert report.target is not None and set(report.target.labels or {}) == {"0", "1"}
        loaded = load_site(node, 0, cfg)  # what it trains on
        assert len(loaded.train) + len(loaded.val) == 30
