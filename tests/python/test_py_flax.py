"""ckptio.flax: flax.training.checkpoints' functions, asynchronous."""
import collections
import inspect
import os

import numpy as np
import pytest


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


Adam = collections.namedtuple("Adam", ["count", "mu", "nu"])


def train_state(step):
    """A TrainState-like pytree of jax arrays, as a flax trainer holds it."""
    import jax.numpy as jnp

    params = {"dense": {"kernel": jnp.full((16, 8), step, jnp.float32),
                        "bias": jnp.full((8,), step, jnp.bfloat16)},
              "layers": [jnp.full((4,), step, jnp.int32), jnp.full((2, 2), -step, jnp.float16)]}
    opt = (Adam(count=jnp.array(step, jnp.int32), mu=params["dense"], nu=params["dense"]), {})
    return {"step": step, "params": params, "opt_state": opt}


def checkpoint_dirs(ckpt_dir):
    return sorted(p for p in os.listdir(ckpt_dir) if not p.startswith("."))


def test_the_reported_loop_saves_every_step_with_keep_3_then_restores_the_latest(tmp_path, flax_ckpt):
    # The report: flax's save_checkpoint blocked the trainer for the whole
    # write. The same loop, one import changed.
    checkpoints = flax_ckpt
    ckpt_dir = str(tmp_path / "ckpt")
    state = train_state(0)
    for step in range(1, 11):
        state = train_state(step)
        path = checkpoints.save_checkpoint(ckpt_dir, state, step, keep=3)
        assert path == os.path.join(ckpt_dir, f"checkpoint_{step}")
    restored = checkpoints.restore_checkpoint(ckpt_dir, target=train_state(0))

    assert restored["step"] == 10 and type(restored["step"]) is int
    import jax

    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
        assert same(got, np.asarray(want))
    assert type(restored["params"]["layers"]) is list and isinstance(restored["opt_state"][0], Adam)
    assert checkpoints.latest_checkpoint(ckpt_dir) == os.path.join(ckpt_dir, "checkpoint_10")
    assert checkpoints.available_steps(ckpt_dir) == [8, 9, 10]
    assert checkpoint_dirs(ckpt_dir) == ["checkpoint_10", "checkpoint_8", "checkpoint_9"]


def test_signatures_match_flax(flax_ckpt):
    # flax.training.checkpoints' own (flax 0.12, annotations left out): a
    # call that passes flax's keywords (async_manager=, parallel=, ...) works.
    sig = inspect.signature
    assert str(sig(flax_ckpt.save_checkpoint)) == (
        "(ckpt_dir, target, step, prefix='checkpoint_', keep=1, overwrite=False, keep_every_n_steps=None, "
        "async_manager=None, orbax_checkpointer=None)")
    assert str(sig(flax_ckpt.save_checkpoint_multiprocess)) == (
        "(ckpt_dir, target, step, prefix='checkpoint_', keep=1, overwrite=False, keep_every_n_steps=None, "
        "async_manager=None, gda_manager=None, orbax_checkpointer=None)")
    assert str(sig(flax_ckpt.restore_checkpoint)) == (
        "(ckpt_dir, target, step=None, prefix='checkpoint_', parallel=True, gda_manager=None, "
        "allow_partial_mpa_restoration=False, orbax_checkpointer=None, orbax_transforms=None)")
    assert str(sig(flax_ckpt.latest_checkpoint)) == "(ckpt_dir, prefix='checkpoint_')"
    assert str(sig(flax_ckpt.available_steps)) == "(ckpt_dir, prefix='checkpoint_', step_type=<class 'int'>)"
    assert str(sig(flax_ckpt.wait_until_finished)) == "()"


def test_a_loop_with_flaxs_async_manager_runs_with_only_its_import_changed(tmp_path, flax_ckpt):
    checkpoints = flax_ckpt
    ckpt_dir = str(tmp_path / "ckpt")
    am = checkpoints.AsyncManager()
    for step in range(1, 4):
        checkpoints.save_checkpoint(ckpt_dir, train_state(step), step, keep=2, async_manager=am)
    am.wait_previous_save()
    assert checkpoint_dirs(ckpt_dir) == ["checkpoint_2", "checkpoint_3"]  # committed and pruned once waited for
    restored = checkpoints.restore_checkpoint(ckpt_dir, train_state(0), parallel=False)
    assert same(restored["params"]["dense"]["kernel"], np.full((16, 8), 3, np.float32))
    with pytest.raises(NotImplementedError, match="orbax_transforms is not supported"):
        checkpoints.restore_checkpoint(ckpt_dir, train_state(0), orbax_transforms={"a": "b"})


def test_async_manager_save_async_runs_tasks_in_turn_and_hands_back_their_failure(flax_ckpt):
    am = flax_ckpt.AsyncManager()
    ran = []
    am.save_async(lambda: ran.append(1))
    am.save_async(lambda: ran.append(2))  # after the first has finished
    am.wait_previous_save()
    assert ran == [1, 2]
    am.save_async(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        am.wait_previous_save()


def test_restoring_from_the_returned_path_or_without_target_gives_the_state_dict(tmp_path, flax_ckpt):
    state = {"params": [np.arange(3.0), np.ones((2, 2), np.int8)], "step": 7, "scale": np.float32(0.5),
             "name": "resnet", "nothing": None}
    path = flax_ckpt.save_checkpoint(tmp_path / "ckpt", state, 7, prefix="test_", keep=1)
    assert path == str(tmp_path / "ckpt" / "test_7")
    restored = flax_ckpt.restore_checkpoint(path, target=None, prefix="test_")
    # As flax: lists become dicts keyed "0", "1", ...; scalars stay scalars.
    assert list(restored["params"]) == ["0", "1"]
    assert same(restored["params"]["0"], np.arange(3.0)) and same(restored["params"]["1"], state["params"][1])
    assert restored["step"] == 7 and type(restored["step"]) is int
    assert isinstance(restored["scale"], np.float32) and restored["scale"] == 0.5
    assert restored["name"] == "resnet" and restored["nothing"] is None
    again = flax_ckpt.restore_checkpoint(tmp_path / "ckpt", target=state, prefix="test_")
    assert type(again["params"]) is list and same(again["params"][0], np.arange(3.0))


def test_restore_returns_the_target_unchanged_when_there_is_no_checkpoint(tmp_path, flax_ckpt):
    target = {"w": np.zeros(3)}
    assert flax_ckpt.restore_checkpoint(tmp_path / "missing", target) is target
    (tmp_path / "empty").mkdir()
    assert flax_ckpt.restore_checkpoint(tmp_path / "empty", target) is target
    assert flax_ckpt.latest_checkpoint(tmp_path / "missing") is None
    assert flax_ckpt.latest_checkpoint(tmp_path / "empty") is None
    with pytest.raises(ValueError, match="Matching checkpoint not found: .*checkpoint_3"):
        flax_ckpt.restore_checkpoint(tmp_path / "empty", target, step=3)


def test_an_outdated_step_raises_unless_overwrite(tmp_path, flax_ckpt):
    ckpt_dir = tmp_path / "ckpt"
    for step in (1, 2, 5):
        flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.full(2, step)}, step, keep=5)
    with pytest.raises(flax_ckpt.InvalidCheckpointError, match='outdated checkpoint at step: "3"'):
        flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.zeros(2)}, 3, keep=5)
    with pytest.raises(flax_ckpt.InvalidCheckpointError, match='step: "5"'):
        flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.zeros(2)}, 5, keep=5)
    # overwrite: the newer checkpoints go, the step is (re)written.
    flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.full(2, 30)}, 2, keep=5, overwrite=True)
    assert flax_ckpt.available_steps(ckpt_dir) == [1, 2]
    assert same(flax_ckpt.restore_checkpoint(ckpt_dir, None)["x"], np.full(2, 30))
    with pytest.raises(ValueError, match="integer steps"):
        flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.zeros(2)}, 7.5)
    flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.zeros(2)}, 8.0, keep=5)  # an integral float is fine
    assert flax_ckpt.latest_checkpoint(ckpt_dir).endswith("checkpoint_8")


def flax_keep_rule(steps, keep, keep_every_n_steps):
    """flax's _remove_invalid_ckpts, applied after each save as flax does."""
    present = []
    for step in steps:
        present.append(step)
        if len(present) > keep:
            last_kept = -float("inf")
            for old in list(present[:-keep]):
                if keep_every_n_steps and old and old - last_kept >= keep_every_n_steps:
                    last_kept = old
                    continue
                present.remove(old)
    return present


@pytest.mark.parametrize("keep,every,steps", [
    (2, 3, list(range(1, 11))),
    (1, 4, list(range(0, 20, 2))),
    (3, None, list(range(5, 50, 5))),
])
def test_keep_and_keep_every_n_steps_prune_as_flax_does(tmp_path, flax_ckpt, keep, every, steps):
    ckpt_dir = tmp_path / "ckpt"
    for step in steps:
        flax_ckpt.save_checkpoint(ckpt_dir, {"x": np.full(2, step)}, step, keep=keep,
                                  keep_every_n_steps=every)
    flax_ckpt.wait_until_finished()
    want = flax_keep_rule(steps, keep, every)
    assert flax_ckpt.available_steps(ckpt_dir) == want
    assert checkpoint_dirs(ckpt_dir) == sorted(f"checkpoint_{s}" for s in want)


def test_save_returns_before_the_write_and_wait_until_finished_commits(tmp_path, flax_ckpt, monkeypatch):
    ckpt_dir = tmp_path / "ckpt"
    big = np.ones(16 << 20, np.uint8)
    flax_ckpt.save_checkpoint(ckpt_dir, {"big": big}, 1)
    big[:] = 0  # the trainer moves on while the save is written
    flax_ckpt.wait_until_finished()
    assert os.path.exists(ckpt_dir / "checkpoint_1" / "manifest.json")
    assert flax_ckpt.restore_checkpoint(ckpt_dir, None)["big"].min() == 1
