"""Recording an evaluation episode to an MP4 file (``impala eval --video FILE.mp4``).

Gymnasium's ``RecordVideo`` does the work: the env renders ``rgb_array`` frames and MoviePy
encodes them. Both can be missing (MoviePy is optional, classic-control rendering needs
pygame); :func:`check_video_support` says what to install before anything runs.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym

from impala_rl.envs.factory import EnvError, EnvFactory

INSTALL_ENCODER = "pip install 'impala-rl[video]' (MoviePy, which brings ffmpeg)"


def check_video_support(factory: EnvFactory) -> None:
    """Raise an :class:`EnvError` saying what to install when MoviePy is missing or the env
    cannot render ``rgb_array`` frames (``factory`` must already ask for that render mode)."""
    try:
        import moviepy  # noqa: F401
    except ImportError:
        raise EnvError(f"--video needs an MP4 encoder: {INSTALL_ENCODER}") from None
    env = factory()
    try:
        env.reset(seed=0)
        frame = env.render()
    except gym.error.DependencyNotInstalled as exc:
        raise EnvError(f"--video: env {factory.env_id!r} cannot render frames: {exc}") from None
    finally:
        env.close()
    if frame is None or getattr(frame, "ndim", 0) != 3:
        raise EnvError(
            f"--video: env {factory.env_id!r} renders no rgb_array frames "
            "(it must accept render_mode='rgb_array')"
        )


def recording_factory(factory: EnvFactory, path: Path) -> tuple[Callable[[], gym.Env], Path]:
    """A factory whose env records its first episode; returns it and the folder it writes to.

    :func:`finish_recording` moves the video to ``path`` once the env is closed.
    """
    folder = Path(tempfile.mkdtemp(prefix=".video-", dir=path.parent))

    def make() -> gym.Env:
        return gym.wrappers.RecordVideo(
            factory(),
            str(folder / "episodes"),  # a new folder: RecordVideo warns about an existing one
            episode_trigger=lambda episode: episode == 0,
            name_prefix="eval",
            disable_logger=True,
        )

    return make, folder


def finish_recording(folder: Path, path: Path) -> Path:
    """Move the recorded episode from ``folder`` to ``path`` and remove ``folder``."""
    try:
        videos = sorted(folder.glob("episodes/*.mp4"))
        if not videos:
            raise EnvError(f"--video: no frames were recorded for {str(path)!r}")
        videos[0].replace(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return path
