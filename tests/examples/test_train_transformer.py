"""The transformer example: one step of the model, and a short run on tokens."""

from __future__ import annotations

import numpy as np
import pytest

from grain_cells.synthetic import _tahoe as synthetic

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tx") / "tiny.h5ad"
    synthetic.write_tahoe_like(path, 1_600, n_genes=120, mean_nnz=30)
    return str(path)


@pytest.mark.slow  # JAX compiles: seconds on a loaded machine
def test_one_step_lowers_the_loss_on_a_batch():
    from grain_cells.examples.train.transformer import CellTransformer

    model = CellTransformer(
        vocab_size=50, length=12, width=16, heads=2, num_layers=1, num_classes=3
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 50, (8, 12)).astype(np.int32)
    ids[:, 0] = 1
    mask = np.arange(12)[None, :] < rng.integers(2, 13, 8)[:, None]
    ids[~mask] = 0
    labels = rng.integers(0, 3, 8)
    # Compiled whole, as the trainer runs it: run eagerly, each of the
    # model's operations compiled on its own (twice the time).
    apply = jax.jit(model.apply)
    params = jax.jit(model.init)(jax.random.key(0), ids, mask)["params"]

    @jax.jit
    def loss(p):
        logits = apply({"params": p}, ids, mask)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    tx = optax.sgd(1e-3)
    state = tx.init(params)
    before = loss(params)
    updates, state = tx.update(jax.jit(jax.grad(loss))(params), state)
    after = loss(optax.apply_updates(params, updates))
    assert np.isfinite(before) and after < before
    # Padding does not leak into real positions: changing a padded token
    # leaves the logits alone.
    other = ids.copy()
    other[~mask] = 7
    np.testing.assert_allclose(
        apply({"params": params}, ids, mask),
        apply({"params": params}, other, mask),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow
def test_train_and_evaluate_on_token_batches(data_file, tmp_path, monkeypatch):
    from grain_cells.examples.train import train_and_evaluate
    from grain_cells.examples.train.configs import transformer

    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    config = transformer.get_config()
    config.data = data_file
    config.eval_fraction = 0.1
    config.num_genes = 64
    config.batch_size = 32
    config.fetch_factor = 4
    config.token_length = 24
    config.hidden_size = 16
    config.num_layers = 1
    config.num_steps = 2
    config.checkpoint_every = 2
    config.log_every = 1
    result = train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 2
    assert np.isfinite(result["loss"]) and 0 <= result["eval_accuracy"] <= 1
    assert list((tmp_path / "cache").glob("grain_cells-corpus-stats-*.npz"))
    # Rerun resumes from the checkpoint (the token iterator restores).
    config.num_steps = 3
    again = train_and_evaluate(config, str(tmp_path / "run"))
    assert again["resumed_from"] == 2 and again["step"] == 3
