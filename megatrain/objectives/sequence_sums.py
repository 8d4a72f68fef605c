"""The preference stages (dpo, kto, orpo, simpo) as an objective the engine runs: per-sequence
sums of token log-probs taken a chunk of tokens at a time, the loss over those sums
(preference.py), and each token's gradient through its sequence's.

A micro-batch carries its samples (pairs or KTO examples) whole; `MicroBatch.slots` says which sum
each predicted token feeds (data/preference.py's codes: slot code * samples + sample) and
`MicroBatch.extra` each sample's reference log-probs (and KTO's label). `loss_and_grads` takes two
passes over the head: `Head.forward` for every slot's sum of log-probs (and of mean logits, for the
metrics), then the loss and its derivative w_s for each sum s, then `Head.backward` with each
chunk's term the sum over its tokens of w_slot * log-prob, which is the loss's gradient by the chain
rule. The full logits never exist; the second pass costs one more head forward.

The step's loss is TRL's under gradient accumulation: each micro-batch's loss is the mean over its
samples (TRL's batch), and the step's is their mean over every micro-batch of the step on every
rank (`count` is 1 a micro-batch). KTO's KL
term is TRL's over several processes: each micro-batch's estimate is averaged with the other
ranks' micro-batches of the same place in the step (evaluation keeps each micro-batch's own: its
ranks take different steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..data.batch import MicroBatch
from ..data.preference import CHOSEN, CHOSEN_PROMPT, COMPLETION, KL, PAIR_SUMS, REJECTED, UNPAIRED_SUMS
from ..determinism import sorted_sums
from .base import Objective
from .logprobs import entropy, is_top1, log_normaliser, token_logps
from .losshead import Head
from .preference import (
    PairedLogps,
    PreferenceConfig,
    PreferenceResult,
    UnpairedLogps,
    kl_estimate,
    loss_and_grads,
    preference_loss,
)


@dataclass
class _Targets:
    """One micro-batch's targets on the device."""

    tokens: Tensor  # [N] the token each position predicts (0 where none)
    slots: Tensor  # [N] the sum it feeds, -1 for none
    samples: int
    extra: Tensor | None  # [samples, k] float32


@dataclass
class _Sums:
    """One micro-batch's per-slot sums: log-probs, token counts, mean logits, and for TRL's metrics
    entropies and tokens that are the most likely."""

    logps: Tensor
    counts: Tensor
    logits: Tensor
    entropy: Tensor
    top1: Tensor


class Preference(Objective):
    """The preference loss of `cfg` over micro-batches of preference samples."""

    def __init__(self, cfg: PreferenceConfig, collective=None):
        self.cfg, self.collective = cfg, collective
        self.paired = cfg.stage != "kto"
        self.codes = PAIR_SUMS if self.paired else UNPAIRED_SUMS

    # ------------------------------------------------------------------ the interface
    def targets(self, mb: MicroBatch, device: torch.device) -> _Targets:
        if mb.slots is None or mb.units is None:
            raise ValueError("a preference objective needs micro-batches of preference samples (slots)")
        tokens = mb.input_ids.new_zeros(mb.input_ids.shape)
        tokens[:, :-1] = mb.input_ids[:, 1:]
        extra = None if mb.extra is None else mb.extra.to(device, torch.float32)
        return _Targets(
            tokens.reshape(-1).to(device, non_blocking=True),
            mb.shifted_slots.reshape(-1).to(device, non_blocking=True),
            len(mb.units),
            extra,
        )

    def count(self, mb: MicroBatch) -> int:
        return 1  # the step's loss is the mean of its micro-batches' (TRL's accumulation)

    def loss_and_grads(
        self, head: Head, hidden: list[Tensor], targets: list[_Targets], total: int
    ) -> tuple[Tensor, list[Tensor]]:
        sums = self.sums(head, hidden, targets)
        batches = [self._batch(t, s) for t, s in zip(targets, sums)]
        self._token_metrics(sums, [t.samples for t in targets])
        results = iter(self._losses(batches))
        weights, loss = [], head.loss_sum  # the step's running sum (`Head.loss_sum`)
        for t in targets:
            result = next(results)
            self.record(result.metrics)
            loss += result.loss
            weights.append(self._slot_weights(result.grads, t.samples, total))

        def chunk_loss(m: int, a: int, logits: Tensor):
            t, n = targets[m], logits.shape[0]
            term = (weights[m][t.slots[a : a + n] + 1] * token_logps(logits, t.tokens[a : a + n])).sum()
            return term, None

        _, dh = head.backward(hidden, chunk_loss)
        return loss / total, dh

    def _losses(self, batches: list) -> list[PreferenceResult]:
        """Each micro-batch's loss and gradients, in the step's order. In a world of several ranks
        what couples the micro-batches of a step is shared first: KTO's KL term."""
        c = self.collective
        if c is not None and c.world_size > 1 and self.cfg.needs_kl:
            batches = self._shared_kl(batches)
        return [loss_and_grads(self.cfg, b) for b in batches]

    def _shared_kl(self, batches: list[UnpairedLogps]) -> list[UnpairedLogps]:
        """KTO's KL term as TRL takes it in a world of several ranks: at each forward every rank's
        micro-batch estimate is gathered and their mean is the KL (clamped at 0 by the loss). A
        rank's m-th micro-batch of the step meets the other ranks' m-th, as TRL's processes meet at
        their m-th forward under gradient accumulation. Every rank computes the same means."""
        shared = self.collective.each([float(kl_estimate(b)) for b in batches])
        return [
            dataclasses.replace(
                b, shared_kl=torch.tensor([values[m] for values in shared], device=b.logps.device).mean()
            )
            for m, b in enumerate(batches)
        ]

    def loss_sum(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> Tensor:
        loss = torch.zeros((), device=head.W.device)
        sums = self.sums(head, hidden, targets)
        self._token_metrics(sums, [t.samples for t in targets])
        for t, s in zip(targets, sums):
            value, metrics = preference_loss(self.cfg, self._batch(t, s))
            self.record(metrics)
            loss += value.detach()
        return loss

    # ------------------------------------------------------------------ per-sequence sums
    @torch.no_grad()
    def sums(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> list[_Sums]:
        """Every micro-batch's per-slot sums of token log-probs, token counts and vocabulary-mean
        logits, from the head's chunks (the same chunks `Head.backward` runs)."""
        dev = head.W.device
        out = []
        for t in targets:
            n = self.codes * t.samples
            s = _Sums(*(torch.zeros(n + 1, device=dev) for _ in range(5)))  # slot -1 lands at 0
            with sorted_sums():
                s.counts.index_add_(0, t.slots + 1, torch.ones_like(t.slots, dtype=torch.float32))
            out.append(s)
        for m, a, logits in head.forward(hidden):
            t, s, n = targets[m], out[m], logits.shape[0]
            at = t.slots[a : a + n] + 1
            lse = log_normaliser(logits)
            logps, means = token_logps(logits, t.tokens[a : a + n], lse), logits.mean(-1)
            with sorted_sums():  # a sequence's tokens summed in order, not atomically, on CUDA
                s.logps.index_add_(0, at, logps)
                s.logits.index_add_(0, at, means)
                s.entropy.index_add_(0, at, entropy(logits, lse))
                s.top1.index_add_(0, at, is_top1(logits, t.tokens[a : a + n]).float())
        return [_Sums(*(getattr(s, f.name)[1:] for f in dataclasses.fields(s))) for s in out]

    def _token_metrics(self, sums: list[_Sums], samples: list[int]) -> None:
        """TRL 1.16's `entropy` (dpo: over the chosen and rejected completions' tokens; kto: the
        completions') and dpo's `mean_token_accuracy` (the chosen completions') of each micro-batch;
        0 where it has no such token. The other stages' TRL trainers log neither."""
        if self.cfg.stage not in ("dpo", "kto"):
            return
        codes = (CHOSEN, REJECTED) if self.paired else (COMPLETION,)
        rows = torch.stack([
            torch.stack((_over(s.entropy, codes, k), _over(s.counts, codes, k),
                         _over(s.top1, codes[:1], k), _over(s.counts, codes[:1], k)))
            for s, k in zip(sums, samples)
        ])  # fmt: skip
        for ent, n, top1, n_chosen in rows.tolist():  # one copy to the host for the step
            metrics = {"entropy": ent / n if n else 0.0}
            if self.paired:
                metrics["mean_token_accuracy"] = top1 / n_chosen if n_chosen else 0.0
            self.record(metrics)

    def _batch(self, t: _Targets, s: _Sums) -> PairedLogps | UnpairedLogps:
        """The loss's inputs of one micro-batch from its slot sums and its samples' extras."""
        k = t.samples

        def code(c: int, sums: Tensor) -> Tensor:
            return sums[c * k : (c + 1) * k]

        ref = t.extra
        if self.paired:
            return PairedLogps(
                chosen_logps=code(CHOSEN, s.logps),
                rejected_logps=code(REJECTED, s.logps),
                chosen_lengths=code(CHOSEN, s.counts),
                rejected_lengths=code(REJECTED, s.counts),
                ref_chosen_logps=None if ref is None else ref[:, 0],
                ref_rejected_logps=None if ref is None else ref[:, 1],
                chosen_logits=code(CHOSEN, s.logits),
                rejected_logits=code(REJECTED, s.logits),
                chosen_prompt_logps=code(CHOSEN_PROMPT, s.logps),
                chosen_prompt_lengths=code(CHOSEN_PROMPT, s.counts),
            )
        kl = self.cfg.needs_kl
        return UnpairedLogps(
            logps=code(COMPLETION, s.logps),
            lengths=code(COMPLETION, s.counts),
            labels=ref[:, 0] > 0.5,
            ref_logps=ref[:, 1] if ref.shape[1] > 1 else None,
            kl_logps=code(KL, s.logps) if kl else None,
            ref_kl_logps=ref[:, 2] if kl and ref.shape[1] > 2 else None,
            logits=code(COMPLETION, s.logits),
        )

    def _slot_weights(self, grads: dict[str, Tensor], samples: int, total: int) -> Tensor:
        """d (step loss) / d (each slot's sum), with a 0 in front for slot -1."""
        w = torch.zeros(self.codes * samples + 1, device=next(iter(grads.values())).device)
        fields = (
            {"chosen_logps": CHOSEN, "rejected_logps": REJECTED, "chosen_prompt_logps": CHOSEN_PROMPT}
            if self.paired
            else {"logps": COMPLETION}
        )
        for name, c in fields.items():
            if name in grads:
                w[1 + c * samples : 1 + (c + 1) * samples] = grads[name] / total
        return w


def _over(sums: Tensor, codes: tuple[int, ...], samples: int) -> Tensor:
    """The total of per-slot `sums` over the slots of `codes` (each code's `samples` slots)."""
    return sum(sums[c * samples : (c + 1) * samples].sum() for c in codes)
