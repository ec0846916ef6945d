"""Where epoch statistics go: the console, ``metrics.jsonl``, TensorBoard and W&B."""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from impala_rl.config import RunConfig, to_dict

EVAL_PREFIX = "eval_"

# Statistics shown in the console's epoch table, in order, with their labels.
CONSOLE_STATS = (
    ("episode_return/mean", "return"),
    ("eval_return/mean", "eval"),
    ("episode_length/mean", "length"),
    ("steps_per_second", "steps/s"),
    ("policy_loss/0", "pg loss"),
    ("critic_value_loss/0", "v loss"),
    ("policy_entropy/0", "entropy"),
    ("grad_norm", "|grad|"),
    ("policy_lag/mean", "lag"),
    ("learning_rate", "lr"),
)


def _fmt(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def tag_for(name: str) -> str:
    """TensorBoard tag of a statistic: ``eval/...`` for evaluation, ``train/...`` otherwise."""
    if name.startswith(EVAL_PREFIX):
        return f"eval/{name[len(EVAL_PREFIX) :]}"
    return f"train/{name}"


def select_stats(stats: dict[str, float], patterns: list[str]) -> dict[str, float]:
    """The statistics whose names match any of the glob ``patterns``, in their own order."""
    return {
        name: value
        for name, value in stats.items()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
    }


def plain_epoch_line(epoch: int, env_steps: int, stats: dict[str, float]) -> str:
    """One epoch as ``name=value`` pairs with every statistic at full precision, for logs.

    The table's labels name the console columns; the names here are the statistics' own (as
    in ``metrics.jsonl``), so a log line can be grepped for any of them.
    """
    parts = [f"epoch={epoch}", f"env_steps={env_steps}"]
    parts += [f"{name}={_plain(value)}" for name, value in stats.items()]
    return " ".join(parts)


def _plain(value: float) -> str:
    """A value at full precision: the shortest text that reads back as the same float (as in
    ``metrics.jsonl``)."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(float(value)) if isinstance(value, float) else str(value)


class ConsoleWriter:
    """A live progress bar during the epoch and a compact table after it on a terminal; one
    plain ``name=value`` line per epoch otherwise (a file or pipe: a table there is cut to 80
    columns and truncates its numbers). ``stats``: glob patterns that choose the statistics
    printed (empty: the table's compact columns, or every statistic on a plain line).

    It writes to stderr, a log, so that stdout holds only what the command returns (``impala
    train > summary.json``); whether stderr is a terminal decides between bar and lines. An
    epoch written again (an evaluation that finished after its row) prints one short line of
    the evaluation's statistics, ``epoch=3 eval_return/mean=...``, not the row again."""

    def __init__(
        self,
        total_env_steps: int | None = None,
        console: Console | None = None,
        stats: list[str] | None = None,
    ):
        self.console = console or Console(stderr=True)
        self.patterns = list(stats or [])
        self._printed_epoch: int | None = None  # the last epoch whose row was printed
        self.live = self.console.is_terminal
        columns: list[Any] = [TextColumn("[bold]epoch {task.fields[epoch]}")]
        if total_env_steps:
            columns.append(BarColumn())
        columns += [
            TextColumn("{task.completed:,.0f} steps"),
            TextColumn("{task.fields[sps]:,.0f}/s"),
            TextColumn("return {task.fields[ret]}"),
            TextColumn("lag {task.fields[lag]}"),
            TimeElapsedColumn(),
        ]
        if total_env_steps:
            columns.append(TimeRemainingColumn())
        self.progress = Progress(*columns, console=self.console, transient=False)
        self.task = self.progress.add_task(
            "train", total=total_env_steps, epoch=0, sps=0.0, ret="-", lag="-"
        )
        if self.live:
            self.progress.start()

    def on_update(
        self,
        env_steps: int,
        steps_per_second: float,
        recent_return: float | None,
        lag: float | None,
        epoch: int,
    ) -> None:
        if not self.live:
            return
        self.progress.update(
            self.task,
            completed=env_steps,
            epoch=epoch,
            sps=steps_per_second,
            ret="-" if recent_return is None else f"{recent_return:.1f}",
            lag="-" if lag is None else f"{lag:.1f}",
        )

    def on_epoch(self, epoch: int, env_steps: int, stats: dict[str, float]) -> None:
        if self.patterns:
            stats = select_stats(stats, self.patterns)
        if epoch == self._printed_epoch:
            self._late_evaluation(epoch, stats)
            return
        self._printed_epoch = epoch
        if not self.live:
            line = plain_epoch_line(epoch, env_steps, stats)
            self.console.print(line, soft_wrap=True, markup=False, highlight=False)
            return
        table = Table(
            title=f"epoch {epoch} · {env_steps:,} env steps",
            title_justify="left",
            show_edge=False,
            pad_edge=False,
        )
        if self.patterns:
            shown = [(key, key) for key in stats]
        else:
            shown = [(key, label) for key, label in CONSOLE_STATS if key in stats]
        for _, label in shown:
            table.add_column(label, justify="right")
        table.add_row(*(_fmt(stats[key]) for key, _ in shown))
        self.progress.console.print(table)

    def _late_evaluation(self, epoch: int, stats: dict[str, float]) -> None:
        """The epoch's row again, with an evaluation that finished after it: one line of the
        evaluation statistics the row shows (the table's ``eval`` column on a terminal without
        patterns; every ``eval_*`` statistic chosen otherwise), or nothing if it shows none."""
        if self.live and not self.patterns:
            shown = {key for key, _ in CONSOLE_STATS}
            stats = {name: value for name, value in stats.items() if name in shown}
        late = {name: value for name, value in stats.items() if name.startswith(EVAL_PREFIX)}
        if not late:
            return
        line = " ".join([f"epoch={epoch}", *(f"{name}={_plain(v)}" for name, v in late.items())])
        self.console.print(line, soft_wrap=True, markup=False, highlight=False)

    def close(self) -> None:
        if self.live:
            self.progress.stop()


class JsonlWriter:
    """``metrics.jsonl``: one JSON object per epoch with every statistic.

    A resumed run appends (``append=True``); a new run replaces an old file in its directory.
    """

    def __init__(self, path: Path, append: bool = True):
        # kept open for the run
        self.file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def on_epoch(self, epoch: int, env_steps: int, stats: dict[str, float]) -> None:
        row = {"epoch": epoch, "env_steps": env_steps, **stats}
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardWriter:
    """TensorBoard event files, one scalar per statistic, against total env steps."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def on_epoch(self, epoch: int, env_steps: int, stats: dict[str, float]) -> None:
        for name, value in stats.items():
            self.writer.add_scalar(tag_for(name), value, global_step=env_steps)
        self.writer.add_scalar("train/epoch", epoch, global_step=env_steps)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """Weights & Biases: one ``log`` call per epoch, tagged like TensorBoard, against env steps.

    ``wandb`` is optional; without it this raises a :class:`ConfigError` saying how to get it.
    """

    def __init__(self, project: str, run_dir: Path, config_dict: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            from impala_rl.config import ConfigError

            raise ConfigError(
                "log.wandb=true needs the wandb package: pip install wandb (or set log.wandb=false)"
            ) from None
        run_dir = Path(run_dir)
        self.run = wandb.init(
            project=project, dir=str(run_dir), name=run_dir.name, config=config_dict
        )

    def on_epoch(self, epoch: int, env_steps: int, stats: dict[str, float]) -> None:
        row: dict[str, Any] = {tag_for(name): value for name, value in stats.items()}
        row["train/epoch"] = epoch
        self.run.log(row, step=env_steps)

    def close(self) -> None:
        self.run.finish()


Writer = ConsoleWriter | JsonlWriter | TensorBoardWriter | WandbWriter


def make_writers(
    cfg: RunConfig, run_dir: Path, append: bool = False
) -> tuple[list[Writer], ConsoleWriter | None]:
    """The outputs ``cfg.log`` asks for, in ``run_dir`` (``append``: a resumed run's
    ``metrics.jsonl`` goes on); the console writer also on its own, for live progress."""
    log = cfg.log
    writers: list[Writer] = []
    if log.wandb:  # first: a missing wandb fails before any file is opened
        writers.append(WandbWriter(log.wandb_project, run_dir, to_dict(cfg)))
    if log.jsonl:
        writers.append(JsonlWriter(run_dir / "metrics.jsonl", append=append))
    if log.tensorboard:
        writers.append(TensorBoardWriter(run_dir / "tb"))
    console = (
        ConsoleWriter(cfg.max_env_steps, stats=list(log.console_stats)) if log.console else None
    )
    if console is not None:
        writers.append(console)
    return writers, console
