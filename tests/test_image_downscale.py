"""Images longer than ``env.max_image_side`` a side reach the model downscaled, and images of
floats (``env.float_images``) as ``uint8`` images."""

from __future__ import annotations

import logging

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import image_envs
import impala_rl
from impala_rl import config
from impala_rl.config import ConfigError, config_from_dict, load_config, to_dict
from impala_rl.envs import EnvFactory, images
from impala_rl.envs.images import (
    ConvertedKeyImages,
    ImageConverter,
    ImageReading,
    converted_images,
    downscale,
    downscaled_side,
    float_image_pixels,
)
from impala_rl.envs.structured import StructuredVectorEnv
from impala_rl.envs.vector import NativeVectorEnv
from impala_rl.policy import Policy

SMALL = (3, 85, 128)  # image_envs' 192 x 288 screen, channels first, downscaled to 128
TO_128 = ImageReading(max_side=128)


def _trained(tmp_path, *overrides: str) -> tuple[Policy, dict]:
    """A quiet run of ``overrides`` to its env-step budget; its saved policy."""
    run_dir = tmp_path / "run"
    quiet = ["log.console=false", "log.tensorboard=false"]
    # One learner thread: a CNN's second waits for the core another test worker holds at
    # every op (the large image's run: 81 s against 20 s in the suite).
    one_thread = ["runner.learner_threads=1"]
    summary = impala_rl.train(None, [*one_thread, *overrides, *quiet], run_dir=run_dir)
    assert summary["stopped_because"] == "max_env_steps", summary
    return impala_rl.load_policy(run_dir), summary


def _centres_mean(plane: np.ndarray, height: int, width: int) -> np.ndarray:
    """Slow reference: each output pixel the mean of the source pixels whose centres lie in
    it (half-open on the low side), rows and columns alike."""

    def weights(n_in: int, n_out: int) -> np.ndarray:
        scale = n_in / n_out
        w = np.zeros((n_out, n_in))
        for o in range(n_out):
            low, high = o * scale, (o + 1) * scale
            for i in range(n_in):
                if low < i + 0.5 <= high:
                    w[o, i] = 1.0
        return w / w.sum(axis=1, keepdims=True)

    return weights(plane.shape[0], height) @ plane.astype(float) @ weights(plane.shape[1], width).T


def test_the_longer_side_is_brought_to_the_limit_keeping_the_aspect_ratio():
    assert downscaled_side(400, 600, 128) == (85, 128)
    assert downscaled_side(600, 400, 128) == (128, 85)
    assert downscaled_side(128, 96, 128) == (128, 96)  # not longer: unchanged
    assert downscaled_side(2000, 10, 128) == (128, 1)


@pytest.mark.parametrize("shape", [(192, 288), (400, 600), (131, 97), (129, 500), (256, 256)])
def test_each_pixel_is_the_mean_of_the_source_pixels_whose_centres_it_covers(shape):
    plane = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    small = downscale(plane, "hw", 128)
    assert small.shape == downscaled_side(*shape, 128)
    assert small.dtype == np.uint8
    assert np.abs(small - _centres_mean(plane, *small.shape)).max() <= 1.0  # rounding


@pytest.mark.parametrize("layout", ["hwc", "chw", "nhwc", "nchw"])
def test_every_layout_keeps_its_layout_and_downscales_each_plane_alone(layout):
    rng = np.random.default_rng(1)
    planes = rng.integers(0, 256, (2, 3, 150, 200), dtype=np.uint8)  # [frame, channel, H, W]
    image = {
        "hwc": planes[0].transpose(1, 2, 0),
        "chw": planes[0],
        "nhwc": planes.transpose(0, 2, 3, 1),
        "nchw": planes,
    }[layout]
    small = downscale(np.ascontiguousarray(image), layout, 128)
    frames = planes if layout.startswith("n") else planes[:1]
    expected = np.stack([[downscale(p, "hw", 128) for p in frame] for frame in frames])
    as_planes = {
        "hwc": lambda x: x.transpose(2, 0, 1)[None],
        "chw": lambda x: x[None],
        "nhwc": lambda x: x.transpose(0, 3, 1, 2),
        "nchw": lambda x: x,
    }[layout]
    assert small.flags.c_contiguous
    np.testing.assert_array_equal(as_planes(small), expected)


def test_only_images_longer_than_the_limit_change():
    big = spaces.Box(0, 255, (200, 300, 3), np.uint8)
    small = spaces.Box(0, 255, (64, 64, 3), np.uint8)
    vector = spaces.Box(-1.0, 1.0, (300,), np.float32)
    source = spaces.Dict(
        {"camera": big, "minimap": small, "pos": vector, "pair": spaces.Tuple([big, small])}
    )
    resizer = ImageConverter(source, TO_128)
    assert resizer.changes
    assert resizer.space["camera"].shape == (85, 128, 3)
    assert resizer.space["pair"][0].shape == (85, 128, 3)
    for name in ("minimap", "pos"):
        assert resizer.space[name] is source[name]
    assert resizer.space["pair"][1] is small
    obs = source.sample()
    out = resizer(obs)
    assert out["camera"].shape == (85, 128, 3) and out["pair"][0].shape == (85, 128, 3)
    assert out["minimap"] is obs["minimap"] and out["pos"] is obs["pos"]
    assert not ImageConverter(spaces.Dict({"minimap": small, "pos": vector}), TO_128).changes
    plain = image_envs.SideEnv()
    assert converted_images(plain, ImageReading(max_side=288)) is plain  # none longer
    assert converted_images(plain, ImageReading()) is plain


@pytest.mark.parametrize(
    ("kwargs", "entry"),
    [({}, None), ({"layout": "chw"}, None), ({"layout": "hw"}, None), ({"entry": True}, "screen")],
)
def test_the_factory_downscales_a_large_image_before_the_model_reads_it(kwargs, entry):
    env = EnvFactory("image_envs:make_env", kwargs, max_image_side=128)()
    space = env.observation_space[entry] if entry else env.observation_space
    channels = 1 if kwargs.get("layout") == "hw" else 3
    assert space.shape == (channels, *SMALL[1:])
    obs, _ = env.reset(seed=0)
    assert (obs[entry] if entry else obs).shape == space.shape
    whole = EnvFactory("image_envs:make_env", kwargs, max_image_side=None)()
    whole_space = whole.observation_space[entry] if entry else whole.observation_space
    assert whole_space.shape == (channels, image_envs.HEIGHT, image_envs.WIDTH)


def test_a_frame_stack_of_large_images_is_downscaled_frame_by_frame():
    env = EnvFactory("image_envs:make_env", {}, frame_stack=4, max_image_side=128)()
    assert env.observation_space.shape == (12, *SMALL[1:])
    obs, _ = env.reset(seed=0)
    frame = image_envs.SideEnv()
    first, _ = frame.reset(seed=0)
    np.testing.assert_array_equal(obs[-3:], downscale(first, "hwc", 128).transpose(2, 0, 1))


def test_the_defaults_read_images_and_a_config_saved_before_keeps_them_as_it_did():
    env = load_config("cartpole").env
    assert env.max_image_side == 128 and env.float_images is True
    saved = to_dict(load_config("cartpole"))
    del saved["env"]["max_image_side"], saved["env"]["float_images"]
    old = EnvFactory.of(config_from_dict(saved).env)
    assert old.max_image_side is None and old.float_images is False


def test_an_impossible_limit_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="env.max_image_side"):
        load_config("cartpole", ["env.max_image_side=4"])
    assert load_config("cartpole", ["env.max_image_side=null"]).env.max_image_side is None


def test_a_structured_env_downscales_each_step_keys_images():
    factory = EnvFactory("image_envs:TwoSeatSideEnv", {}, max_image_side=128)
    env = factory()
    assert isinstance(env, ConvertedKeyImages)
    assert env.observation_spaces[0]["screen"].shape == (85, 128, 3)
    assert env.observation_spaces[1].shape == (40, 40, 3)  # small: as it is
    vec = StructuredVectorEnv([factory] * 2)
    vec.reset(seed=0)
    assert vec.obs[0].shape == (2, *SMALL)  # the mask aside, the screen alone
    for _ in range(7):
        vec.step([0, 0])
    vec.step([0, 0])  # the 8th turn truncates: each agent's final observation
    assert vec.final_obs[0][0][1].shape == SMALL
    assert vec.final_obs[0][1][1].shape == (3, 40, 40)
    vec.close()


def test_a_native_vector_env_downscales_its_rows():
    envs = gym.vector.SyncVectorEnv(
        [image_envs.make_env] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    assert NativeVectorEnv.needed(envs, TO_128)
    vec = NativeVectorEnv(envs, images=TO_128)
    assert vec.single_observation_space.shape == SMALL
    obs, _ = vec.reset(seed=0)
    assert obs.shape == (2, *SMALL)
    obs, *_ = vec.step(np.zeros(2, dtype=np.int64))
    assert obs.shape == (2, *SMALL)
    vec.close()


def test_a_large_image_env_learns_and_its_policy_acts_on_full_size_frames(tmp_path):
    """The red square's half of a 192 x 288 screen, read at 43 x 64 (``env.max_image_side=64``:
    the default 128's 85 x 128 learns alike, 8.0 at 12k env steps, in 5x the time): 12k env
    steps evaluate at 7.5 or more of 8 (a random policy 4), and the saved policy, given the
    env's own full-size frames, names the half on >= 95% of them."""
    policy, summary = _trained(
        tmp_path,
        "env.id=image_envs:make_env",
        "env.max_image_side=64",
        "max_env_steps=12288",
        "algorithm.epoch_length=4",
    )
    assert summary["best_eval_return"] >= 7.5, summary
    env = image_envs.SideEnv()
    obs, _ = env.reset(seed=123)
    right = 0
    for _ in range(200):
        side = env.side
        right += int(policy.act(obs)) == side
        obs, *_ = env.step(0)
    assert right >= 190, right
    frames = np.stack([env.reset(seed=s)[0] for s in range(4)])  # a batch of raw frames
    assert np.asarray(policy.act(frames)).shape == (4,)


def test_a_structured_env_with_a_large_image_runs_in_actor_processes(tmp_path):
    policy, _ = _trained(
        tmp_path,
        "env.id=image_envs:TwoSeatSideEnv",
        "runner.backend=subprocess",
        "max_env_steps=2048",
    )
    env = image_envs.TwoSeatSideEnv()
    obs, _ = env.reset(seed=0)  # step key 0's full-size screen
    assert int(policy.act(obs, step_key=0)) in (0, 1)


@pytest.mark.parametrize(
    ("space", "finite", "unit"),
    [
        (spaces.Box(0.0, 1.0, (40, 40, 3), np.float32), (0.0, 255.0), (0.0, 255.0)),
        (spaces.Box(0.0, 255.0, (3, 40, 40), np.float64), (0.0, 1.0), (0.0, 1.0)),
        (spaces.Box(0.0, 1.0, (64, 48), np.float32), (0.0, 255.0), (0.0, 255.0)),
        (spaces.Box(0.0, 1.0, (4, 40, 40, 1), np.float32), (0.0, 255.0), (0.0, 255.0)),
        (spaces.Box(-1.0, 1.0, (40, 40, 3), np.float32), (-1.0, 127.5), None),
        (spaces.Box(-0.5, 0.5, (1, 40, 40), np.float32), (-0.5, 255.0), None),
        (spaces.Box(-np.inf, np.inf, (40, 40, 3), np.float32), None, None),  # no pixels' range
        (spaces.Box(0.0, 1.0, (40, 40, 8), np.float32), None, None),  # 8 channels: features
        (spaces.Box(0.0, 1.0, (5, 40, 3), np.float32), None, None),  # 5 pixels a side
        (spaces.Box(0.0, 1.0, (300,), np.float32), None, None),
        (spaces.Box(0, 1, (40, 40, 3), np.int64), None, None),
    ],
)
def test_a_float_image_is_told_by_its_shape_and_bounds(space, finite, unit):
    """``finite`` (the default) stretches any finite bounds over 0-255; ``unit`` (runs saved
    before) takes ``[0, 1]`` and ``[0, 255]`` only."""
    assert float_image_pixels(space) == finite
    assert float_image_pixels(space, "unit") == unit


def test_a_float_image_with_bounds_per_channel_stretches_each_over_0_255():
    low = np.zeros((40, 40, 3), np.float32) + np.array([-1.0, 0.0, 0.0], np.float32)
    high = np.ones((40, 40, 3), np.float32) * np.array([1.0, 1.0, 10.0], np.float32)
    space = spaces.Box(low, high, dtype=np.float32)
    converter = ImageConverter(space, ImageReading(floats=True))
    assert converter.space == spaces.Box(0, 255, (40, 40, 3), np.uint8)
    value = np.stack([np.full((40, 40), v, np.float32) for v in (0.0, 0.5, 10.0)], axis=-1)
    np.testing.assert_array_equal(converter(value)[0, 0], [128, 128, 255])  # 127.5: to even
    np.testing.assert_array_equal(converter(low)[0, 0], [0, 0, 0])


def test_a_signed_float_image_is_read_as_pixels_and_runs_saved_before_flatten_it():
    """A camera normalized to ``[-1, 1]``: -1, 0 and 1 become 0, 128 and 255 (0 is 127.5,
    rounded to even); a config saved before ``env.float_image_bounds`` reads ``unit`` and
    leaves the image to the MLP, as its weights were trained."""
    space = spaces.Box(-1.0, 1.0, (40, 40, 3), np.float32)
    converter = ImageConverter(space, ImageReading(floats=True))
    assert converter.space == spaces.Box(0, 255, (40, 40, 3), np.uint8)
    value = np.zeros((40, 40, 3), np.float32)
    value[0, 0], value[0, 1] = -1.0, 1.0
    out = converter(value)
    assert (out[0, 0, 0], out[1, 1, 0], out[0, 1, 0]) == (0, 128, 255)
    assert not ImageConverter(space, ImageReading(floats=True, float_bounds="unit")).changes
    saved = to_dict(load_config("cartpole"))
    assert saved["env"]["float_image_bounds"] == "finite"
    del saved["env"]["float_image_bounds"]
    assert config_from_dict(saved).env.float_image_bounds == "unit"


def test_the_float_image_bounds_choices_are_the_readers():
    assert config.FLOAT_IMAGE_BOUNDS == images.FLOAT_IMAGE_BOUNDS


def test_a_float_image_becomes_the_uint8_image_of_its_pixels():
    source = spaces.Dict(
        {
            "camera": spaces.Box(0.0, 1.0, (40, 40, 3), np.float32),
            "depth": spaces.Box(0.0, 255.0, (40, 40), np.float32),
            "pos": spaces.Box(0.0, 1.0, (3,), np.float32),
        }
    )
    converter = ImageConverter(source, ImageReading(floats=True))
    assert converter.space["camera"] == spaces.Box(0, 255, (40, 40, 3), np.uint8)
    assert converter.space["depth"] == spaces.Box(0, 255, (40, 40), np.uint8)
    assert converter.space["pos"] is source["pos"]
    obs = source.sample()
    out = converter(obs)
    np.testing.assert_array_equal(
        out["camera"], np.clip(np.rint(obs["camera"] * 255), 0, 255).astype(np.uint8)
    )
    np.testing.assert_array_equal(out["depth"], np.rint(obs["depth"]).astype(np.uint8))
    again = converter({**obs, "camera": out["camera"], "depth": out["depth"]})
    np.testing.assert_array_equal(again["camera"], out["camera"])  # converted: as it is
    assert not ImageConverter(source, ImageReading()).changes  # floats not asked for


def test_a_large_float_image_is_converted_then_downscaled():
    env = EnvFactory("image_envs:make_env", {"floats": 1}, max_image_side=128, float_images=True)()
    assert env.observation_space == spaces.Box(0, 255, SMALL, np.uint8)
    obs, _ = env.reset(seed=0)
    as_uint8 = image_envs.SideEnv()
    first, _ = as_uint8.reset(seed=0)
    np.testing.assert_array_equal(obs, downscale(first, "hwc", 128).transpose(2, 0, 1))


@pytest.mark.parametrize("low", [0.0, -1.0])
def test_float_frames_train_a_cnn_and_the_policy_takes_them(tmp_path, low):
    """Catch's frames as floats in [0, 1] or [-1, 1] are read by the Nature CNN (PPO's Atari
    reuse), as its uint8 frames are; the saved policy acts on the float frames."""
    policy, _ = _trained(
        tmp_path,
        "env.id=image_envs:make_float_catch",
        f"env.kwargs.low={low}",
        "max_env_steps=2048",
    )
    assert type(policy.model.policies["0"].torso).__name__ == "NatureCNN"
    assert policy.config.algorithm.num_passes == 4  # PPO's Atari reuse, as for an image
    env = image_envs.make_float_catch(low)
    obs, _ = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs.min() == low
    assert int(policy.act(obs)) in (0, 1, 2)


def test_the_start_up_says_which_images_the_model_reads_changed(caplog):
    from impala_rl.envs.factory import make_env_factory

    caplog.set_level(logging.INFO, logger="impala_rl.envs.factory")
    cases = {
        "env.id=image_envs:make_env": "the observation 192x288x3 -> 85x128x3",
        "env.id=image_envs:make_float_catch": "the observation float 40x40x3 as uint8",
        "env.id=image_envs:TwoSeatSideEnv": "step key 0: 'screen' 192x288x3 -> 85x128x3",
    }
    for override, phrase in cases.items():
        caplog.clear()
        make_env_factory(load_config(None, [override]).env)
        assert phrase in caplog.text, caplog.text
    caplog.clear()
    make_env_factory(
        load_config(None, ["env.id=image_envs:make_env", "env.max_image_side=null"]).env
    )
    assert "the model reads" not in caplog.text
