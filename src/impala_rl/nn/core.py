"""The optional recurrent core between the encoder and the heads: an LSTM that resets on
episode starts.

The state is a pair ``(h, c)``, each ``[1, B, H]`` (one layer, batch on axis 1, as
:class:`torch.nn.LSTM` has it), so a rollout slot can store it with the batch on axis 1 like
every other field.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor, nn

from impala_rl.config import CORES

__all__ = ["CORES", "CoreState", "LSTMCore", "bf16_lstm_supported"]

log = logging.getLogger(__name__)

CoreState = tuple[Tensor, Tensor]
"""``(h, c)``, each ``[1, B, H]``."""


@functools.cache
def _cpu_has_bf16_lstm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def bf16_lstm_supported(device: torch.device | str) -> bool:
    """Whether an LSTM runs under bf16 autocast on ``device``: on a GPU, and on a CPU whose
    oneDNN has bf16 kernels (AVX-512); on an AVX2-only CPU oneDNN refuses the bf16 LSTM
    ("could not create a primitive descriptor")."""
    return torch.device(device).type != "cpu" or _cpu_has_bf16_lstm()


class LSTMCore(nn.Module):
    """One LSTM layer over a time-major sequence ``[T, B, in_features]``.

    Where ``first[t]`` is true the state is zeroed before step ``t``: an episode starts there.
    The sequence is cut at the steps where any column starts an episode and each piece runs as
    one :class:`torch.nn.LSTM` call, which is exact (a reset only happens at a piece's first
    step) and much faster than a Python loop over every step.

    ``precision="bf16"`` runs the core under bf16 autocast where :func:`bf16_lstm_supported`
    (else in fp32, said once on the log: the rest of the model keeps bf16).
    """

    def __init__(self, in_features: int, hidden_size: int, precision: str = "fp32") -> None:
        super().__init__()
        self.precision = precision  # bf16: runs under bf16 autocast, returns float32
        if hidden_size < 1:
            raise ValueError(f"lstm hidden size must be >= 1, got {hidden_size}")
        self.in_features = int(in_features)
        self.hidden_size = int(hidden_size)
        self.out_features = self.hidden_size
        self.lstm = nn.LSTM(self.in_features, self.hidden_size)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.zeros_(param)
            else:
                nn.init.orthogonal_(param)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu") -> CoreState:
        """Zeros ``(h, c)``, each ``[1, batch_size, H]``."""
        shape = (1, batch_size, self.hidden_size)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def forward(
        self, x: Tensor, first: Tensor | None, state: CoreState | None
    ) -> tuple[Tensor, CoreState]:
        """``x [T, B, in]``, ``first [T, B]`` (``None``: no episode starts), ``state`` the state
        before step 0 (``None``: zeros). Returns ``y [T, B, H]`` and the state after step
        ``T - 1``, float32 whatever the precision."""
        if self.precision != "bf16":
            return self._run(x, first, state)
        if not bf16_lstm_supported(x.device):
            _say_fp32_core()
            with torch.autocast(x.device.type, enabled=False):
                return self._run(x.float(), first, state)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y, (h, c) = self._run(x, first, state)
        return y.float(), (h.float(), c.float())

    def _run(
        self, x: Tensor, first: Tensor | None, state: CoreState | None
    ) -> tuple[Tensor, CoreState]:
        if x.ndim != 3:
            raise ValueError(f"LSTMCore needs a time-major input [T, B, F], got {tuple(x.shape)}")
        T, B = x.shape[0], x.shape[1]
        if x.is_cuda:
            # a deep copy (APPO's target, the evaluator's model) leaves cuDNN's weights apart,
            # which it would then compact at every call; once here is a no-op when they are not
            self.lstm.flatten_parameters()
        if state is None:
            state = self.initial_state(B, x.device)
        h, c = state
        if first is None:
            y, (h, c) = self.lstm(x, (h.to(x.dtype), c.to(x.dtype)))
            return y, (h, c)
        if tuple(first.shape) != (T, B):
            raise ValueError(f"first must be [T, B] = [{T}, {B}], got {tuple(first.shape)}")
        keep = (~first.bool()).to(x.dtype).unsqueeze(-1)  # [T, B, 1]
        starts = [0, *torch.nonzero(first[1:].any(dim=1)).flatten().add(1).tolist(), T]
        outputs = []
        for t0, t1 in zip(starts[:-1], starts[1:], strict=True):
            if t1 <= t0:
                continue
            h = h.to(x.dtype) * keep[t0]
            c = c.to(x.dtype) * keep[t0]
            y, (h, c) = self.lstm(x[t0:t1], (h, c))
            outputs.append(y)
        return torch.cat(outputs, dim=0) if len(outputs) > 1 else outputs[0], (h, c)


@functools.cache
def _say_fp32_core() -> None:
    log.warning(
        "model.precision=bf16: this CPU has no bf16 LSTM kernels (oneDNN needs AVX-512), so "
        "the LSTM core runs in fp32 here; the rest of the model runs in bf16"
    )
