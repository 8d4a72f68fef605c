"""The stale sampler (`max_staleness: 1`): what rollout.py keeps between the sampling of a
generation batch and its training one step later, and how a checkpoint keeps it.

The generation batches a step k+1 starts are sampled by the weights step k starts from: at the
start of step k, once step k-1's update is in, the policy is built on the device of those weights
(a `Snapshot`). Where it holds a copy of every weight (all layers on the device:
`PolicyModel.owns_weights`) it is kept through step k's update and sampled at the start of step
k+1, while step k's host AdamW runs; else (streamed layers fetched from the master's bf16 halves,
which that AdamW rewrites) it is sampled at once. A batch sampled and not
yet trained on is `Sampled`: its completions, whether each was cut, and each token's log-prob
under the sampler. Before an evaluation or a checkpoint (`Rollout.settle`) a snapshot is sampled:
a checkpoint then holds its batches (PENDING_FILE, every rank's) and a resume trains on them, as
the weights they were sampled by are not in it. Step 1's and a resume's first batches, which no
step before sampled, are sampled by the weights they train from.

The snapshot is the rollout's own policy, built earlier: its bytes are the rollout's room on the
GPU (footprint.rollout_bytes, "policy weights"), which the update's plan never takes
(plan.py `_less_rollout`).
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError

PENDING_FILE = "rollout_pending.pt"  # in a checkpoint after which a stale batch waits


@dataclass
class Sampled:
    """A generation batch sampled, not yet scored nor trained on: for step `step`'s micro-batch
    `offset` on, the `generation`-th of the run."""

    units: list[int]  # its prompts' indices in the dataset (each num_generations times)
    step: int
    offset: int
    generation: int
    completions: list[list[int]]
    truncated: list[bool]
    logps: list[list[float]] | None  # each completion token's log-prob under the sampler
    metrics: dict[str, float] = field(default_factory=dict)  # its sampling's times, streamed bytes


@dataclass
class Snapshot:
    """The policy of the weights a step starts from, for the generation batches the next step
    starts (their first micro-batches of the run, `starts`)."""

    step: int
    starts: list[int]
    policy: object  # rl/policy.py's PolicyModel
    timing: dict[str, float]  # its build's: the wait for the last update, the build

    def take_timing(self) -> dict[str, float]:
        """Its build's times, for the first batch sampled from it (0 for the others)."""
        out, self.timing = self.timing, dict.fromkeys(self.timing, 0.0)
        return out


class StaleSampler:
    """A rollout's batches sampled ahead (`pending`, by their generation batch's index in the run)
    and the snapshot it holds (rl/rollout.py's Rollout: its `build_policy`, `sample_batch`)."""

    def __init__(self, pending: dict[int, Sampled] | None = None):
        self.pending = pending or {}
        self.snapshot: Snapshot | None = None

    def ahead(self, rollout, step: int) -> None:
        """At the start of step `step` - 1, the generation batches step `step` starts: their
        policy built now of the weights this step starts from (its wait: the last update), kept
        for `settle` where it holds its own copy of them, else sampled now, before this step's
        update writes them."""
        starts = generation_starts(step, rollout.cfg)
        if not starts:
            return
        cuda = rollout.device.type == "cuda"
        with torch.random.fork_rng(devices=[rollout.device] if cuda else []):  # the model's init draws
            base = torch.cuda.memory_allocated(rollout.device) if cuda else 0
            policy = rollout.build_policy()
            if cuda:
                rollout.memory["rollout_snapshot"] = torch.cuda.memory_allocated(rollout.device) - base
        self.snapshot = Snapshot(step, starts, policy, dict(rollout.timing))
        if not policy.owns_weights:
            self.settle(rollout)

    def settle(self, rollout) -> None:
        """The snapshot's generation batches sampled into `pending`, its policy freed: at its
        step, and before an evaluation or a checkpoint."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is None:
            return
        ga, per = rollout.cfg.gradient_accumulation_steps, rollout.cfg.micro_batches_per_generation
        rollout.model.transport.run_updates()  # the last step's host AdamW runs while these sample
        with snapshot.policy:
            for micro in snapshot.starts:
                self.pending[micro // per] = rollout.sample_batch(
                    snapshot.step, micro % ga, micro // per, snapshot
                )
        del snapshot
        if rollout.device.type == "cuda":
            torch.cuda.empty_cache()

    def state(self, world) -> bytes | None:
        """PENDING_FILE's bytes: every rank's batches sampled and not trained on (None: none).
        Called by every rank."""
        mine = {g: asdict(s) for g, s in self.pending.items()}
        ranks = world.each(mine) if world.world_size > 1 else [mine]
        if not any(ranks):
            return None
        buffer = io.BytesIO()
        torch.save(ranks, buffer)
        return buffer.getvalue()


def generation_starts(step: int, cfg) -> list[int]:
    """The micro-batches of the run (0-based) in optimizer step `step` that start a generation
    batch: those a multiple of steps_per_generation x num_iterations."""
    ga = cfg.gradient_accumulation_steps
    return [m for m in range((step - 1) * ga, step * ga) if m % cfg.micro_batches_per_generation == 0]


def load_ranks(path: Path) -> list:
    """Every rank's records of a checkpoint's file of them (torch.save's, tensors and plain
    values only); a corrupt one is one line."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # pickle/zip errors of a corrupt file; their messages run to pages
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__})") from None


def resumed_pending(checkpoint: Path, world) -> dict[int, Sampled]:
    """This rank's batches sampled and not trained on that a checkpoint holds (empty: none)."""
    path = Path(checkpoint) / PENDING_FILE
    if not path.is_file():
        return {}
    ranks = load_ranks(path)
    if len(ranks) != world.world_size:
        raise CheckpointError(
            f"{path}: the sampled batches of {len(ranks)} processes; resume it with {len(ranks)} processes"
        )
    return {int(g): Sampled(**fields) for g, fields in ranks[world.rank].items()}
