"""What the engine asks of a training objective (objectives/__init__.py says why it is this)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ..data.batch import MicroBatch
from .losshead import Head


class Objective(ABC):
    """A step's loss, taken from the last hidden states a chunk of tokens at a time.

    The engine calls `targets` for each micro-batch before its forward sweep, sums `count` over
    the step's micro-batches and the world's ranks, runs the sweep, then hands every micro-batch's
    last hidden states to `loss_and_grads` (training) or `loss_sum` (evaluation) with the loss
    head bound to its weights; the gradients `loss_and_grads` returns enter the backward sweep.
    """

    empty_step_ok = False
    """Whether a step whose `count` is 0 is a step (its loss 0) rather than an error."""

    shares_prompts = False
    """Whether the layers may compute a prompt that several rows share once (data/shared.py):
    the loss reads none of its tokens' hidden states but those of the rows' own positions."""

    @property
    def coupled(self) -> str:
        """Why a call of `loss_and_grads` over one micro-batch at a time would not give the bits of
        one call over the step's micro-batches (the engine then runs the update layer-major); ""
        where it does: nothing but `total` and the head's running sum and buffers
        (`Head.loss_sum`) joins the micro-batches, as in every objective in a world of one."""
        return ""

    @abstractmethod
    def targets(self, mb: MicroBatch, device: torch.device) -> Any:
        """What the loss needs of one micro-batch, on `device` (copied once, before the sweep)."""

    @abstractmethod
    def count(self, mb: MicroBatch) -> int:
        """What one micro-batch adds to the step's normaliser (summed over all ranks)."""

    @abstractmethod
    def loss_and_grads(
        self, head: Head, hidden: list[torch.Tensor], targets: list[Any], total: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's share of the step's loss (an fp32 device scalar; the engine sums the ranks')
        and its gradient w.r.t. each micro-batch's last hidden states, the head's own gradients
        added into `head`'s buffers (`Head.backward`), its loss's terms into `head.loss_sum`.
        `total`: the step's summed `count`. A micro-batch-major update calls it once a micro-batch
        (one hidden state, one target) with the same `head`: the last call's loss is the step's."""

    @abstractmethod
    def loss_sum(self, head: Head, hidden: list[torch.Tensor], targets: list[Any]) -> torch.Tensor:
        """Forward only: the numerator of the loss over these micro-batches (an fp32 device
        scalar), whose ratio to their summed `count` is the loss; the chunks `loss_and_grads` runs,
        in the same order."""

    extremes: dict[str, str] = {}
    """Metrics TRL takes over every process's batch at once, name -> "min" or "max": each
    micro-batch's value meets the other ranks' of its place in the step (metrics.mean_metrics)."""

    def take_metrics(self) -> dict[str, tuple[str, list[float]]]:
        """The metrics of the micro-batches seen since the last call, by name (TRL's): how they
        meet over the ranks ("mean", or `extremes`'), and each micro-batch's value in order, which
        metrics.mean_metrics reduces. None unless the objective `record`s some: cross-entropy's
        loss is the trainer's own record."""
        taken = getattr(self, "_metrics", {})
        self._metrics: dict[str, list[float]] = {}
        return {k: (self.extremes.get(k, "mean"), v) for k, v in taken.items()}

    def record(self, metrics: dict[str, float]) -> None:
        """Add one micro-batch's (or one step's) metrics for `take_metrics`."""
        if not hasattr(self, "_metrics"):
            self._metrics = {}
        for k, v in metrics.items():
            self._metrics.setdefault(k, []).append(v)

    def state_dict(self) -> dict:
        """What the objective carries from one step to the next, JSON-serialisable, saved with a
        checkpoint (none by default)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 (optional: most keep no state)
        """Continue from a checkpoint's `state_dict`."""
