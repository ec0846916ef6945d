"""PopArt value head: normalized outputs, unnormalized values (van Hasselt et al. 2016;
Hessel et al. 2019 for IMPALA).

The linear layer predicts a normalized value ``n(x)``; the head returns ``sigma * n(x) + mu``,
so everything that reads values (V-trace, truncation bootstraps, evaluation) sees returns on
the env's scale. The learner moves ``mu`` and ``sigma`` towards the first and second moments of
the V-trace targets (:meth:`update_statistics`) and then rescales the layer so that its
unnormalized outputs are exactly what they were (:meth:`preserve_outputs`): the statistics
change what the layer learns, never what the policy sees. The learner trains the layer on
normalized targets and divides the policy-gradient advantages by ``sigma``, so a rescaled
reward gives the same updates once the statistics have adapted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

SIGMA_MIN = 1e-4
SIGMA_MAX = 1e6


class PopArtValueHead(nn.Module):
    """``[*batch, F]`` -> ``[*batch, 1]`` unnormalized values; statistics as buffers."""

    def __init__(self, in_features: int, beta: float = 3e-4):
        super().__init__()
        self.linear = nn.Linear(in_features, 1)
        self.beta = float(beta)
        self.register_buffer("mu", torch.zeros(()))
        self.register_buffer("nu", torch.ones(()))  # second moment: sigma starts at 1

    @property
    def weight(self) -> Tensor:  # the layer's, for callers that read a head's weight
        return self.linear.weight

    @property
    def sigma(self) -> Tensor:
        return (self.nu - self.mu.pow(2)).clamp(SIGMA_MIN**2, SIGMA_MAX**2).sqrt()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.sigma + self.mu

    @torch.no_grad()
    def update_statistics(
        self, targets: Tensor, all_sum: Callable[[Tensor], Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Move ``mu``, ``nu`` by ``beta`` towards the moments of ``targets``; returns the old
        ``(mu, sigma)`` for :meth:`preserve_outputs`.

        ``all_sum`` (several learners) sums a tensor over the learners: the moments are then
        those of every learner's targets together (no move when none has any)."""
        old = (self.mu.clone(), self.sigma.clone())
        t = targets.detach().float()
        if all_sum is None:
            self.mu.lerp_(t.mean(), self.beta)
            self.nu.lerp_(t.pow(2).mean(), self.beta)
            return old
        sums = all_sum(torch.stack([t.sum(), t.pow(2).sum(), t.new_tensor(t.numel())]))
        if sums[2] > 0:
            self.mu.lerp_(sums[0] / sums[2], self.beta)
            self.nu.lerp_(sums[1] / sums[2], self.beta)
        return old

    @torch.no_grad()
    def preserve_outputs(self, old_mu: Tensor, old_sigma: Tensor) -> None:
        """Rescale the layer (and its gradients, if any) so that unnormalized outputs are
        unchanged by the last statistics update."""
        sigma = self.sigma
        w, b = self.linear.weight, self.linear.bias
        w.mul_(old_sigma / sigma)
        b.mul_(old_sigma).add_(old_mu - self.mu).div_(sigma)
        # a gradient taken before the rescale is d/d(old layer); the new layer's is sigma/old
        for p in (w, b):
            if p.grad is not None:
                p.grad.mul_(sigma / old_sigma)
