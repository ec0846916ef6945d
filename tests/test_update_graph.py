"""The captured update (``algorithm.cuda_graph``): one CUDA graph per batch shape on a GPU, its
optimizer step included, the same static-buffer path eagerly on a CPU. Either way it must take
the eager update's steps, read its figures a step late when asked, and undo a non-finite step."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch

from batches import vector_batch
from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig
from impala_rl.learner import Learner, NonFiniteError, capture_refusal
from impala_rl.nn.factory import build_model

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


def _vector_model(core: str = "none"):
    torch.manual_seed(0)
    return build_model(
        ModelConfig(
            hidden_sizes=[32, 32], core=core, lstm_hidden_size=16, shared_torso=core != "none"
        ),
        gym.spaces.Box(-5, 5, (3,)),
        gym.spaces.Discrete(2),
    )


def _atari_model():
    torch.manual_seed(0)
    return build_model(
        ModelConfig(encoder="nature_cnn"),
        gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
        gym.spaces.Discrete(6),
    )


def _atari_batch(T: int, B: int) -> dict[str, torch.Tensor]:
    batch = vector_batch(T, B, n_actions=6)
    batch["obs"] = torch.randint(0, 256, (T + 1, B, 4, 84, 84), dtype=torch.uint8)
    return batch


def _pair(model, cfg: ImpalaAlgorithmConfig, device: str) -> tuple[Learner, Learner]:
    eager = Learner(copy.deepcopy(model), cfg, device, capture=False)
    captured = Learner(copy.deepcopy(model), cfg, device, capture=True)
    return eager, captured


def _assert_same_weights(a: Learner, b: Learner) -> None:
    for (name, x), y in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def _train_both(eager: Learner, captured: Learner, batches, device: str) -> None:
    """The trainer's sequence on each: passes over minibatches, a burn-in step, the entropy
    coefficient and the learning rate moving between batches. cuDNN's deterministic
    algorithms: its default backward convolutions sum in a varying order, and the steps
    would drift apart by more than rounding over a few updates whatever the capture."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        _train_in_step(eager, captured, batches, device)


def _train_in_step(eager: Learner, captured: Learner, batches, device: str) -> None:
    for i, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        for learner in (eager, captured):
            learner.entropy_coef = 0.01 * (i + 1)
            learner.set_learning_rate(1e-3 / (i + 1))
        for n in range(eager.cfg.num_passes):
            torch.manual_seed(100 * i + n)  # the same minibatch order for both
            blocks_eager = list(eager.minibatches(batch))
            torch.manual_seed(100 * i + n)
            blocks_captured = list(captured.minibatches(batch))
            for a, b in zip(blocks_eager, blocks_captured, strict=True):
                train_policy = i > 0  # the first batch is critic burn-in
                sa = eager.update(a, train_policy=train_policy, fresh=n == 0)
                sb = captured.update(b, train_policy=train_policy, fresh=n == 0)
                assert sb.total_loss == pytest.approx(sa.total_loss, rel=1e-4, abs=1e-6)
                assert sb.grad_norm == pytest.approx(sa.grad_norm, rel=1e-4, abs=1e-6)
                assert sb.policy_entropy == pytest.approx(sa.policy_entropy, rel=1e-4)
                assert sb.policy_lag == sa.policy_lag


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"policy_loss": "appo", "num_passes": 2, "num_minibatches": 2},
        {"optimizer": "adam", "normalize_advantages": True, "max_grad_norm": None},
    ],
    ids=["impala", "appo-2x2", "adam-normalized"],
)
def test_the_captured_update_gives_the_eager_updates_weights(device, settings):
    cfg = ImpalaAlgorithmConfig(lr=1e-3, **settings)
    eager, captured = _pair(_vector_model(), cfg, device)
    torch.manual_seed(1)
    batches = [vector_batch(8, 4) for _ in range(3)]
    _train_both(eager, captured, batches, device)
    assert eager.num_updates == captured.num_updates == 3 * cfg.num_passes * cfg.num_minibatches
    _assert_same_weights(eager, captured)
    assert not torch.equal(
        next(iter(eager.model.parameters())), next(iter(_vector_model().parameters())).to(device)
    ), "the updates moved the weights"


def test_the_static_buffer_path_of_an_lstm_core_gives_the_eager_weights():
    """On a GPU a core is refused (its sequence is cut on the host); on a CPU the captured
    path's buffers and coefficients still give the eager steps."""
    cfg = ImpalaAlgorithmConfig(lr=1e-3, policy_loss="appo", num_passes=2)
    eager, captured = _pair(_vector_model(core="lstm"), cfg, "cpu")
    torch.manual_seed(2)
    batches = []
    for _ in range(2):
        batch = vector_batch(6, 4)
        batch["core_h"], batch["core_c"] = torch.randn(1, 4, 16), torch.randn(1, 4, 16)
        batch["first"][3, 1] = True
        batches.append(batch)
    _train_both(eager, captured, batches, "cpu")
    _assert_same_weights(eager, captured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_captured_update_of_the_atari_network_gives_the_eager_weights_on_cuda():
    cfg = ImpalaAlgorithmConfig(lr=1e-4, policy_loss="appo", num_passes=2, num_minibatches=2)
    eager, captured = _pair(_atari_model(), cfg, "cuda")
    torch.manual_seed(4)
    _train_both(eager, captured, [_atari_batch(20, 4) for _ in range(3)], "cuda")
    assert captured._graph is not None and captured._graph._captured
    _assert_same_weights(eager, captured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_a_core_is_refused_by_name_and_auto_stays_eager():
    model = _vector_model(core="lstm")
    forced = Learner(copy.deepcopy(model), ImpalaAlgorithmConfig(), "cuda", capture=True)
    batch = vector_batch(6, 4)
    batch["core_h"], batch["core_c"] = torch.zeros(1, 4, 16), torch.zeros(1, 4, 16)
    batch = {k: v.to("cuda") for k, v in batch.items()}
    with pytest.raises(ValueError, match="LSTM core"):
        forced.update(batch)
    auto = Learner(copy.deepcopy(model), ImpalaAlgorithmConfig(), "cuda")
    auto.update(batch)
    assert auto.capture is False and auto._graph is None


@pytest.mark.parametrize("device", DEVICES)
def test_batches_of_two_shapes_each_keep_their_own_capture(device):
    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    eager, captured = _pair(_vector_model(), cfg, device)
    torch.manual_seed(3)
    _train_both(
        eager, captured, [vector_batch(8, 4), vector_batch(8, 2), vector_batch(8, 4)], device
    )
    _assert_same_weights(eager, captured)


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_loss_takes_no_step_in_a_captured_update(device):
    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    learner = Learner(_vector_model(), cfg, device, capture=True)
    learner.update({k: v.to(device) for k, v in vector_batch(8, 4).items()})
    before = [p.detach().clone() for p in learner.model.parameters()]
    bad = vector_batch(8, 4)
    bad["reward"][2, 1] = float("nan")
    with pytest.raises(NonFiniteError, match="not finite"):
        learner.update({k: v.to(device) for k, v in bad.items()})
    assert learner.num_updates == 1
    for b, p in zip(before, learner.model.parameters(), strict=True):
        assert torch.equal(b, p.detach())


def test_what_cannot_be_captured_says_why():
    model = _vector_model()
    assert capture_refusal(model, torch.device("cpu"), None) == "the learner is not on a GPU"
    assert capture_refusal(model, torch.device("cuda"), None) is None
    popart = build_model(
        ModelConfig(hidden_sizes=[8], popart=True),
        gym.spaces.Box(-1, 1, (3,)),
        gym.spaces.Discrete(2),
    )
    assert "PopArt" in capture_refusal(popart, torch.device("cuda"), None)
    assert "core" in capture_refusal(_vector_model(core="lstm"), torch.device("cuda"), None)
    cfg = ImpalaAlgorithmConfig(cuda_graph=False)
    assert Learner(_vector_model(), cfg).capture is False
    assert Learner(_vector_model(), ImpalaAlgorithmConfig()).capture is None  # decided at use


def test_the_captured_update_takes_the_optimizer_step_in_its_program():
    """The step runs inside the captured function (on a GPU: in the graph), once per update
    after the warm-up, whose steps are undone (the weights match the eager ones above)."""
    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    learner = Learner(_vector_model(), cfg, "cpu", capture=True)
    taken = []
    learner.optimizer.register_step_post_hook(lambda *_: taken.append(learner.num_updates))
    batch = vector_batch(8, 4)
    for _ in range(3):
        learner.update(batch)
    assert learner._graph is not None and learner._graph.steps
    assert taken == [0, 0, 0] + [0, 1, 2]  # the warm-up's 3 (undone), then one per update


def test_a_capture_that_fails_with_the_step_falls_back_to_the_host_step(monkeypatch, caplog):
    """Should the step not capture, the update is captured without it and the host steps:
    the same weights as the eager update, and the run says why."""
    from impala_rl import learner as learner_module

    def broken(self):
        raise RuntimeError("not capturable here")

    monkeypatch.setattr(learner_module.CapturedStep, "take", broken)
    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    eager, captured = _pair(_vector_model(), cfg, "cpu")
    torch.manual_seed(1)
    _train_both(eager, captured, [vector_batch(8, 4) for _ in range(2)], "cpu")
    assert captured._graph is not None and not captured._graph.steps
    assert "could not be captured" in caplog.text and "not capturable here" in caplog.text
    _assert_same_weights(eager, captured)


def test_a_captured_runs_optimizer_state_loads_as_a_plain_one():
    """A GPU run's captured step saves its rate as a tensor and its optimizer capturable; a
    resume (on a CPU too) loads a float rate and a plain optimizer that steps."""
    from impala_rl.learner import load_optimizer_state

    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    saved = Learner(_vector_model(), cfg)
    saved.update(vector_batch(8, 4))
    group = saved.optimizer.param_groups[0]
    group["lr"], group["capturable"] = torch.tensor(5e-4), True
    saved.set_learning_rate(2e-4)
    assert float(group["lr"]) == pytest.approx(2e-4) and saved.learning_rate == 2e-4
    resumed = Learner(_vector_model(), cfg)
    load_optimizer_state(resumed.optimizer, saved.optimizer.state_dict(), cfg)
    group = resumed.optimizer.param_groups[0]
    assert group["capturable"] is False and group["lr"] == pytest.approx(2e-4)
    assert isinstance(group["lr"], float)
    resumed.update(vector_batch(8, 4))
    assert resumed.num_updates == 1


def test_updates_settled_later_give_the_eager_steps_and_figures_in_order():
    """``settle_later``: a captured update returns before its figures are read; the next
    update, a target move or ``settle()`` reads them. The steps, their figures and the update
    count are the eager update's, in order (appo: the target moves once a batch)."""
    cfg = ImpalaAlgorithmConfig(lr=1e-3, policy_loss="appo", num_passes=2, num_minibatches=2)
    eager, captured = _pair(_vector_model(), cfg, "cpu")
    torch.manual_seed(1)
    batches = [vector_batch(8, 4) for _ in range(2)]
    for i, batch in enumerate(batches):
        read_eager, read_later = [], []
        for n in range(cfg.num_passes):
            torch.manual_seed(10 * i + n)
            for block in list(eager.minibatches(batch)):
                read_eager.append(eager.update(block, fresh=n == 0))
            torch.manual_seed(10 * i + n)
            for block in list(captured.minibatches(batch)):
                assert captured.update(block, fresh=n == 0, settle_later=True) is None
        read_later = captured.settle()
        assert captured.settle() == []
        assert [s.total_loss for s in read_later] == pytest.approx(
            [s.total_loss for s in read_eager], rel=1e-5
        )
        assert [s.policy_lag for s in read_later] == [s.policy_lag for s in read_eager]
        assert captured.num_updates == eager.num_updates == (i + 1) * 4
    _assert_same_weights(eager, captured)


@pytest.mark.parametrize("found_by", ["settle", "next update"])
def test_a_non_finite_step_settled_later_is_undone_before_anything_runs_on_it(found_by):
    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    learner = Learner(_vector_model(), cfg, "cpu", capture=True)
    learner.update(vector_batch(8, 4))
    before = [p.detach().clone() for p in learner.model.parameters()]
    bad = vector_batch(8, 4)
    bad["reward"][2, 1] = float("nan")
    assert learner.update(bad, settle_later=True) is None  # not read yet
    with pytest.raises(NonFiniteError, match="not finite"):
        if found_by == "settle":
            learner.settle()
        else:
            learner.update(vector_batch(8, 4), settle_later=True)
    assert learner.num_updates == 1
    for b, p in zip(before, learner.model.parameters(), strict=True):
        assert torch.equal(b, p.detach())


def test_a_second_shapes_capture_keeps_the_copies_the_first_graph_writes():
    """Each shape's graph copies the weights aside into tensors it captured by address; a
    later shape's capture must leave those tensors in place (a graph writes where it was
    captured), and a non-finite step of either shape is undone from them."""
    cfg = ImpalaAlgorithmConfig(lr=1e-3)
    learner = Learner(_vector_model(), cfg, "cpu", capture=True)
    learner.update(vector_batch(8, 4))
    step = learner._captured_step
    assert step is not None
    first = [id(t) for t in step._backup]
    learner.update(vector_batch(8, 2))  # a second shape: captured again
    assert [id(t) for t in step._backup] == first
    before = [p.detach().clone() for p in learner.model.parameters()]
    bad = vector_batch(8, 4)
    bad["reward"][2, 1] = float("nan")
    with pytest.raises(NonFiniteError):
        learner.update(bad)
    for b, p in zip(before, learner.model.parameters(), strict=True):
        assert torch.equal(b, p.detach())
