"""Every parallel mode trains the same weights as `client.train.fit` on the same batches.

``data`` and ``pipeline`` start real gloo process groups on 127.0.0.1 (free ports, bounded
waits); ``model`` runs in this process with both stages on the CPU, through the same hand-off
code a two-GPU site runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedsplit.client.models import ModelSpec, SiteModel, build_model
from fedsplit.client.parallel import ParallelRunError, default_device_map, fit_parallel, parse_device_map
from fedsplit.client.parallel.layer_split import LayerSplit
from fedsplit.client.parallel.pipeline import train_pipeline
from fedsplit.client.parallel.replicas import train_replicas
from fedsplit.client.train import fit

CNN = ModelSpec("cnn", "classification", (1, 8, 8), 10)
MLP = ModelSpec("mlp", "classification", (12,), 3)
REG = ModelSpec("mlp", "regression", (12,), 1)
CPU2 = [torch.device("cpu")] * 2
RUN = {"start_method": "auto", "timeout_s": 60.0}


def _data(spec: ModelSpec, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *spec.input_shape)).astype(np.float32)
    if spec.task == "classification":
        return x, rng.integers(0, spec.num_outputs, n)
    return x, (x[:, 0] * 3 + rng.normal(size=n)).astype(np.float32)


def _assert_same_weights(a: SiteModel, b: SiteModel, atol: float) -> None:
    for (name, wa), wb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(wb, wa, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _full_batch_grads(model: SiteModel, x: np.ndarray, y: np.ndarray) -> dict[str, torch.Tensor]:
    """The single-device reference: one forward/backward of the mean loss over every row."""
    model.zero_grad()
    out = model(torch.as_tensor(x))
    torch.nn.functional.cross_entropy(out, torch.as_tensor(y)).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_data_parallel_two_gloo_processes_equal_single_process_training() -> None:
    x, y = _data(MLP, 50)
    kw = {"epochs": 3, "lr": 1e-2, "batch_size": 16, "seed": 3, "proximal_mu": 0.1}  # 12 steps
    ref = build_model(MLP, seed=1)
    ref_loss = fit(ref, x, y, **kw)
    model = build_model(MLP, seed=1)
    result = fit_parallel(model, x, y, parallel="data:replicas=2", **kw)
    assert (result.mode, result.workers) == ("data", 2)
    assert result.metrics()["parallel-mode"] == "data"
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_same_weights(ref, model, atol=1e-6)
    assert not any(torch.equal(a, b) for a, b in zip(  # it did train
        build_model(MLP, seed=1).parameters(), model.parameters(), strict=True))


def test_data_parallel_gradients_are_the_full_batch_gradients() -> None:
    x, y = _data(CNN, 21)  # shards of 11 and 10 rows: uneven on purpose
    ref = build_model(CNN, seed=1)
    want = _full_batch_grads(ref, x, y)
    model = build_model(CNN, seed=1)
    run = train_replicas(model, x, y, devices=CPU2, epochs=1, lr=1e-3, batch_size=21, seed=0,
                         proximal_mu=0.0, keep_grads=True, **RUN)
    assert set(run.grads) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(run.grads[name], grad, rtol=1e-5, atol=1e-7)


def test_model_parallel_step_hands_off_once_and_matches_one_device() -> None:
    x, y = _data(CNN, 24)
    ref = build_model(CNN, seed=1)
    want = _full_batch_grads(ref, x, y)
    torch.optim.Adam(ref.parameters(), lr=1e-2).step()

    model = build_model(CNN, seed=1)
    device_map = parse_device_map("norm+body.0-2/body.3-6", model)
    split = LayerSplit(model, device_map, CPU2)
    assert {p.device for p in split.stages[0].parameters()} == {CPU2[0]}
    assert {p.device for p in split.stages[1].parameters()} == {CPU2[1]}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = torch.nn.functional.cross_entropy(split(torch.as_tensor(x)), torch.as_tensor(y))
    loss.backward()  # one ordinary train step
    assert split.handoffs == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-8)
    optimizer.step()
    _assert_same_weights(ref, model, atol=1e-7)


def test_model_parallel_training_equals_fit() -> None:
    x, y = _data(REG, 40)
    kw = {"epochs": 2, "lr": 1e-2, "batch_size": 16, "seed": 5, "proximal_mu": 0.1}
    ref = build_model(REG, seed=2)
    ref_loss = fit(ref, x, y, **kw)
    model = build_model(REG, seed=2)
    result = fit_parallel(model, x, y, parallel="model:stages=3", **kw)
    assert result.config == "model:stages=3,map=norm+body.0-1/body.2-3/body.4"
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_same_weights(ref, model, atol=1e-7)


def test_pipeline_gradients_and_step_equal_the_full_batch_run() -> None:
    x, y = _data(CNN, 50)  # 3 micro-batches of 17 rows, one of them padded
    ref = build_model(CNN, seed=1)
    want = _full_batch_grads(ref, x, y)
    torch.optim.Adam(ref.parameters(), lr=1e-3).step()
    model = build_model(CNN, seed=1)
    run = train_pipeline(model, x, y, device_map=default_device_map(model, 2), devices=CPU2,
                         microbatches=3, epochs=1, lr=1e-3, batch_size=50, seed=0, proximal_mu=0.0,
                         keep_grads=True, **RUN)
    assert set(run.grads) == set(want)  # both stages sent their gradients back
    for name, grad in want.items():
        torch.testing.assert_close(run.grads[name], grad, rtol=1e-5, atol=1e-7)
    # Adam's first step is lr * g / (|g| + eps): for a gradient near eps, the summation-order
    # difference the line above allows (micro-batches accumulate) moves a weight by up to about
    # lr * 1e-3 (one element of 65,536 moved 1.14e-6 in a CI run); beyond that is a real error.
    _assert_same_weights(ref, model, atol=2e-6)


def test_pipeline_three_stages_training_equals_fit() -> None:
    x, y = _data(REG, 45)
    kw = {"epochs": 2, "lr": 1e-2, "batch_size": 16, "seed": 7, "proximal_mu": 0.1}  # last batch: 13
    ref = build_model(REG, seed=4)
    ref_loss = fit(ref, x, y, **kw)
    model = build_model(REG, seed=4)
    result = fit_parallel(model, x, y, parallel="pipeline:stages=3,microbatches=4", **kw)
    assert (result.mode, result.workers) == ("pipeline", 3)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_same_weights(ref, model, atol=1e-6)


def test_a_failing_worker_is_reported_not_hung() -> None:
    x, _ = _data(MLP, 12)
    bad = np.full(12, 7)  # class 7 of a 3-class model: cross-entropy fails inside the workers
    with pytest.raises(ParallelRunError, match="Target 7 is out of bounds"):
        fit_parallel(build_model(MLP, seed=0), x, bad, epochs=1, lr=1e-3, batch_size=4, seed=0,
                     parallel="data:replicas=2,timeout=60")


def test_a_run_past_its_timeout_is_stopped() -> None:
    x, y = _data(MLP, 64)
    with pytest.raises(ParallelRunError, match=r"did not finish within 0\.5 s"):
        fit_parallel(build_model(MLP, seed=0), x, y, epochs=10_000, lr=1e-3, batch_size=4, seed=0,
                     parallel="data:replicas=2,timeout=0.5")
