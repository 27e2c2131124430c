"""Parallel configuration strings, device maps (and their refusals), and the GPipe tick table."""

from __future__ import annotations

import numpy as np
import pytest
import typer
from fedsplit.cli.errors import run_guarded
from fedsplit.cli.pipeline_schedule import pipeline_schedule
from fedsplit.client.models import ModelSpec, SiteModel
from fedsplit.client.parallel import (
    ParallelConfig,
    default_device_map,
    fit_parallel,
    gpipe_table,
    layer_names,
    parse_device_map,
)
from fedsplit.protocol.errors import ConfigError
from typer.testing import CliRunner

CNN = ModelSpec("cnn", "classification", (1, 8, 8), 10)
MLP = ModelSpec("mlp", "classification", (12,), 3)


def test_config_string_round_trip() -> None:
    cfg = ParallelConfig.parse("pipeline:stages=3, microbatches=6,map=norm+body.0-2/body.3-6")
    assert (cfg.mode, cfg.stages, cfg.microbatches, cfg.device_map) == (
        "pipeline", 3, 6, "norm+body.0-2/body.3-6")
    assert ParallelConfig.parse(cfg.to_string()) == cfg
    assert ParallelConfig.parse("data:replicas=4,timeout=30").to_string() == "data:replicas=4,timeout=30"
    assert ParallelConfig.parse("none").workers == 1


@pytest.mark.parametrize(("text", "needle"), [
    ("tensor", "Parallel mode must be one of"),
    ("data:stages=2", "takes options key=value with keys"),
    ("data:replicas=two", "must be an integer"),
    ("data:replicas=0", "from 1 to 64"),
    ("pipeline:microbatches", "takes options key=value"),
    ("data:start=thread", "start must be one of"),
])
def test_bad_config_strings_are_refused(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        ParallelConfig.parse(text)
    assert "Received:" in str(err.value)


def test_default_maps_follow_the_seed_split() -> None:
    cnn = SiteModel(CNN)
    assert layer_names(cnn) == ["norm"] + [f"body.{i}" for i in range(7)]
    # convolution + pooling on device 0; flatten + dense layers on device 1
    assert default_device_map(cnn, 2).stages == (
        ("norm", "body.0", "body.1", "body.2"), ("body.3", "body.4", "body.5", "body.6"))
    assert default_device_map(cnn, 3).to_string() == "norm+body.0-2/body.3-5/body.6"
    assert default_device_map(cnn, 8).to_string() == "norm/" + "/".join(f"body.{i}" for i in range(7))
    mlp = SiteModel(MLP)
    assert default_device_map(mlp, 2).to_string() == "norm+body.0-1/body.2-4"


def test_map_string_and_dict_forms_agree() -> None:
    cnn = SiteModel(CNN)
    by_text = parse_device_map("norm + body.0-2 / body.3-6", cnn)
    by_dict = parse_device_map({n: (0 if i < 4 else 1) for i, n in enumerate(layer_names(cnn))}, cnn)
    assert by_text == by_dict
    assert by_text.to_string() == "norm+body.0-2/body.3-6"
    stages = by_text.build(cnn)
    assert stages[0][1] is cnn.body[0]  # stages share the model's modules, no copies


@pytest.mark.parametrize(("device_map", "needle"), [
    ("norm+body.0-2/body.3-7", "Unknown layer 'body.7'"),
    ("norm+body.0-2/conv", "Unknown layer 'conv'"),
    ("norm+body.0-2//body.3-6", "Stage 1 of the device map is empty"),
    ("norm+body.0-6/", "Stage 1 of the device map is empty"),
    ({"norm": 0, "body.0": 0, "body.1": 0, "body.2": 0, "body.3": 2, "body.4": 2, "body.5": 2,
      "body.6": 2}, "Stage 1 of the device map is empty"),
    ("norm/body.0/body.1/body.2/body.3/body.4/body.5/body.6/body.6", "has 9 stages but the model has only 8"),
    ("norm+body.0-2/body.2-6", "placed on more than one stage"),
    ("norm+body.0-2/body.4-6", "leaves out layer(s) body.3"),
    ("body.3-6/norm+body.0-2", "consecutive layers in forward order"),
    ("", "at least one stage"),
])
def test_bad_device_maps_are_refused(device_map: str | dict[str, int], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_device_map(device_map, SiteModel(CNN))
    assert needle in str(err.value)
    assert "Received:" in str(err.value)


@pytest.mark.parametrize("parallel", [
    "model:map=norm+body.0-2/body.9",
    "pipeline:map=norm+body.0-2//body.3-6",
    "pipeline:stages=9",
    "model:stages=9",
])
def test_fit_parallel_refuses_a_map_that_does_not_fit(parallel: str) -> None:
    model = SiteModel(CNN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = np.zeros((8, 1, 8, 8), dtype=np.float32)
    with pytest.raises(ConfigError, match="Received:"):
        fit_parallel(model, x, np.zeros(8, dtype=np.int64), epochs=1, lr=1e-3, batch_size=4, seed=0,
                     parallel=parallel)
    assert all((before[k] == v).all() for k, v in model.state_dict().items())


def test_pipeline_refuses_more_microbatches_than_rows() -> None:
    x = np.zeros((8, 12), dtype=np.float32)
    with pytest.raises(ConfigError, match="cannot fill 6 micro-batches"):
        fit_parallel(SiteModel(MLP), x, np.zeros(8, dtype=np.int64), epochs=1, lr=1e-3, batch_size=4,
                     seed=0, parallel="pipeline:microbatches=6")


def test_gpipe_table_three_by_three() -> None:
    table = gpipe_table(3, 3)
    assert table.forward_ticks == 5 and table.sequential_ticks == 9
    assert table.cells == (
        ("F0", "F1", "F2", "", "", "", "", "B0", "B1", "B2"),
        ("", "F0", "F1", "F2", "", "", "B0", "B1", "B2", ""),
        ("", "", "F0", "F1", "F2", "B0", "B1", "B2", "", ""),
    )
    assert table.phases[:5] == ("fill", "fill", "steady", "drain", "drain")
    assert table.bubble == pytest.approx(2 / 5)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 4), (4, 2), (4, 8), (5, 3)])
def test_gpipe_table_respects_dependencies(stages: int, microbatches: int) -> None:
    table = gpipe_table(stages, microbatches)
    when = {cell: t for row in table.cells for t, cell in enumerate(row) if cell}
    at = {(s, c): t for s, row in enumerate(table.cells) for t, c in enumerate(row) if c}
    assert len(when) == 2 * microbatches and len(at) == 2 * stages * microbatches
    for s in range(stages):
        for m in range(microbatches):
            if s > 0:  # a stage needs the previous stage's activation
                assert at[(s, f"F{m}")] > at[(s - 1, f"F{m}")]
            if s < stages - 1:  # and the next stage's gradient
                assert at[(s, f"B{m}")] > at[(s + 1, f"B{m}")]
            assert at[(s, f"B{m}")] > at[(stages - 1, f"F{microbatches - 1}")]  # GPipe: all F first
    assert table.forward_ticks == stages + microbatches - 1
    assert table.bubble == pytest.approx((stages - 1) / (stages + microbatches - 1))


def test_gpipe_table_refuses_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="--stages must be an integer from 1 to 64"):
        gpipe_table(0, 3)


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("pipeline-schedule")(pipeline_schedule)
    app.command("unused")(lambda: None)  # two commands: typer keeps the sub-command name
    return app


def test_pipeline_schedule_command_prints_and_draws(tmp_path) -> None:
    png = tmp_path / "gpipe.png"
    result = CliRunner().invoke(_cli(), ["pipeline-schedule", "--stages", "3", "--microbatches", "3",
                                         "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert "forward: 5 ticks" in result.output and "instead of 9" in result.output
    assert "stage 2" in result.output and "B2" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pipeline_schedule_command_refuses_bad_sizes(capsys) -> None:
    code = run_guarded(_cli(), ["pipeline-schedule", "--stages", "0"])
    assert code == 2
    assert "Received: 0" in capsys.readouterr().err


def test_pipeline_schedule_is_registered() -> None:
    from fedsplit.cli.app import COMMANDS

    assert "pipeline-schedule" in {name for name, _, _ in COMMANDS}
