"""PopArt value head: normalized outputs, unnormalized values (van Hasselt et al. 2016;
Hessel et al. 2019 for IMPALA).

The linear layer predicts a normalized value ``n(x)``; the head returns ``sigma * n(x) + mu``,
so everything that reads values (V-trace, truncation bootstraps, evaluation) sees returns on
the env's scale. The learner moves ``mu`` and ``sigma`` towards the first and second moments of
the V-trace targets (:meth:`moved_statistics`, taken after the backward by
:meth:`set_statistics`) and then rescales the layer so that its
unnormalized outputs are exactly what they were (:meth:`preserve_outputs`): the statistics
change what the layer learns, never what the policy sees. The learner trains the layer on
normalized targets and divides the policy-gradient advantages by ``sigma``, so a rescaled
reward gives the same updates once the statistics have adapted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

SIGMA_MIN = 1e-4  # the default floor of the scale (``model.popart_sigma_min``)
SIGMA_MAX = 1e6


def sigma_of(mu: Tensor, nu: Tensor, sigma_min: float = SIGMA_MIN) -> Tensor:
    """The standard deviation of statistics with first moment ``mu`` and second ``nu``, at
    least ``sigma_min``."""
    return (nu - mu.pow(2)).clamp(sigma_min**2, SIGMA_MAX**2).sqrt()


class PopArtValueHead(nn.Module):
    """``[*batch, F]`` -> ``[*batch, 1]`` unnormalized values; statistics as buffers.

    ``sigma_min``: the scale never goes under it, so targets of a smaller spread are learned
    as they are (only divided by ``sigma_min``)."""

    def __init__(self, in_features: int, beta: float = 3e-4, sigma_min: float = SIGMA_MIN):
        super().__init__()
        self.linear = nn.Linear(in_features, 1)
        self.beta = float(beta)
        self.sigma_min = float(sigma_min)
        self.register_buffer("mu", torch.zeros(()))
        self.register_buffer("nu", torch.ones(()))  # second moment: sigma starts at 1

    @property
    def weight(self) -> Tensor:  # the layer's, for callers that read a head's weight
        return self.linear.weight

    @property
    def sigma(self) -> Tensor:
        return self.sigma_of(self.mu, self.nu)

    def sigma_of(self, mu: Tensor, nu: Tensor) -> Tensor:
        """This head's scale for the statistics ``(mu, nu)`` (its floor applied)."""
        return sigma_of(mu, nu, self.sigma_min)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.sigma + self.mu

    @torch.no_grad()
    def moved_statistics(
        self, targets: Tensor, all_sum: Callable[[Tensor], Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(mu, nu)`` moved by ``beta`` towards the moments of ``targets``, as new tensors:
        the head's own stay until :meth:`set_statistics`, so an update's graph never sees
        its inputs change between its forward and its backward (nor reads the host).

        ``all_sum`` (several learners) sums a tensor over the learners: the moments are then
        those of every learner's targets together (no move when none has any)."""
        t = targets.detach().float()
        if all_sum is None:
            return self.mu.lerp(t.mean(), self.beta), self.nu.lerp(t.pow(2).mean(), self.beta)
        sums = all_sum(torch.stack([t.sum(), t.pow(2).sum(), t.new_tensor(t.numel())]))
        count = sums[2].clamp(min=1)
        any_rows = sums[2] > 0
        mu = torch.where(any_rows, self.mu.lerp(sums[0] / count, self.beta), self.mu)
        nu = torch.where(any_rows, self.nu.lerp(sums[1] / count, self.beta), self.nu)
        return mu, nu

    @torch.no_grad()
    def set_statistics(self, mu: Tensor, nu: Tensor) -> None:
        """Take the statistics ``(mu, nu)`` (:meth:`moved_statistics`) and rescale the layer
        so that its unnormalized outputs stay what they were (:meth:`preserve_outputs`)."""
        old_mu, old_sigma = self.mu.clone(), self.sigma
        self.mu.copy_(mu)
        self.nu.copy_(nu)
        self.preserve_outputs(old_mu, old_sigma)

    @torch.no_grad()
    def update_statistics(
        self, targets: Tensor, all_sum: Callable[[Tensor], Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Move ``mu``, ``nu`` in place (:meth:`moved_statistics`); returns the old
        ``(mu, sigma)`` for :meth:`preserve_outputs`."""
        old = (self.mu.clone(), self.sigma.clone())
        mu, nu = self.moved_statistics(targets, all_sum)
        self.mu.copy_(mu)
        self.nu.copy_(nu)
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
