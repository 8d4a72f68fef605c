"""Batcher: samples -> optimizer steps of micro-batches, deterministic and exactly resumable.

Without packing each sample is one row, right-padded to the longest row of its micro-batch.
To keep padding low, micro-batches are cut from windows of ~100 micro-batches' worth of
shuffled samples sorted by length, and then the micro-batch order is shuffled again, so
lengths do not drift over the epoch.

With packing, samples are laid into rows of exactly max_length tokens once, up front (first
fit over a few open rows, in a seeded shuffled order), and each epoch shuffles the rows. A
document is never split across rows (samples are at most max_length long; longer ones were
already truncated or split into windows by build_samples); a row's unused tail is padding. Packing once keeps steps_per_epoch fixed, which the LR schedule and resume rely on.

The order of an epoch is a pure function of (seed, epoch), so a resume only needs the epoch
and the position in it. shuffle=False follows the file order exactly (no bucketing).

In a data-parallel world of `ranks` processes an optimizer step is `grad_accum * ranks`
micro-batches, the same ones in the same order as one process with `grad_accum * ranks` would
take; rank r takes the r-th block of `grad_accum` of them. The position is counted in optimizer
steps, so a checkpoint resumes exactly in a world of any size with the same global batch.

A sample of several sequences (`Sample.parts`: a preference pair's chosen and rejected) stays
whole in one micro-batch, each sequence a row of its own (padded to the longest row) or, packed,
a document of its own in a row of `max_length` x (sequences per sample) tokens; max_length then
bounds each sequence (the data cut them), and `batch_size` counts samples. The micro-batch
carries the samples' dataset indices, their per-sequence sum codes as slots and their extras.

Evaluation uses the same Batcher with shuffle=False and drop_last=False: every sample, in file
order, the last micro-batch and step possibly short (`epoch_steps`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence

import torch

from ..errors import DataError
from .batch import IGNORE_INDEX, MicroBatch
from .samples import Sample

log = logging.getLogger(__name__)

BUCKET_WINDOW = 100  # micro-batches per length-sorting window
OPEN_ROWS = 16  # rows that stay open for first-fit packing


class Batcher:
    """Yields one optimizer step (grad_accum micro-batches) per `next_step()`, forever,
    wrapping to a freshly shuffled epoch; the last incomplete optimizer step of an epoch is
    dropped (drop_last=False keeps it, short: evaluation, where every sample counts)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        batch_size: int,
        grad_accum: int,
        max_length: int,
        packing: bool = False,
        shuffle: bool = True,
        seed: int = 42,
        pad_id: int = 0,
        drop_last: bool = True,
        ranks: int = 1,
        pixels=None,
    ):
        if batch_size < 1 or grad_accum < 1 or max_length < 1 or ranks < 1:
            raise ValueError("batch_size, grad_accum, max_length and ranks must be >= 1")
        if not samples:
            raise DataError("no samples to train on")
        self.samples = samples
        self.batch_size, self.grad_accum, self.max_length = batch_size, grad_accum, max_length
        self.ranks = ranks
        self.micro_per_step = grad_accum * ranks  # micro-batches of one optimizer step, all ranks
        self.packing, self.shuffle, self.seed, self.pad_id = packing, shuffle, seed, pad_id
        # A vision-language model's images: (file:line, images) of each row's samples, in order ->
        # the micro-batch's pixel inputs (data/vision.py's `VisionData.pixels`).
        self.pixels = pixels
        if pixels is None and any(s.images for s in samples):
            raise DataError(
                f"{next(s for s in samples if s.images).source}: images need a vision-language model"
            )
        # Over-long samples are truncated here too, so any caller gets rows <= max_length. A
        # sample of several sequences was cut per sequence by its builder.
        self.parted = samples[0].parts is not None
        self.group = len(samples[0].parts) if self.parted else 1
        row = max_length * self.group
        self._lengths = [min(len(s.input_ids), row) for s in samples]
        self._rows: list[list[int]] | None = None
        if packing:
            order = list(range(len(samples)))
            if shuffle:
                random.Random(f"pack-{seed}").shuffle(order)  # independent of the epoch streams
            self._rows = pack_rows(order, self._lengths, row, OPEN_ROWS if shuffle else 1)
        units = len(self._rows) if packing else len(samples)
        self.drop_last = drop_last
        per_step = batch_size * self.micro_per_step
        self.steps_per_epoch = units // per_step if drop_last else -(-units // per_step)
        if self.steps_per_epoch == 0:
            raise DataError(self._too_small(units))
        self._epoch, self._position = 0, 0
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, micro-batches of units)

    @property
    def packed_lengths(self) -> list[int] | None:
        """With packing, the lengths of the documents packed into rows (attention stays inside
        each: the plan's cost of attention); None without packing (whole rows)."""
        return list(self._lengths) if self.packing else None

    def _too_small(self, units: int) -> str:
        need = self.batch_size * self.micro_per_step
        tokens = sum(self._lengths)
        have = f"{len(self.samples)} samples ({tokens} tokens)"
        if self.packing:
            have += f" pack into {units} rows of max_length {self.max_length}"
        return (
            f"dataset too small: {have}, but one optimizer step needs {need} "
            f"{'rows' if self.packing else 'samples'} (per_device_train_batch_size {self.batch_size} "
            f"x gradient_accumulation_steps {self.grad_accum}"
            + (f" x {self.ranks} processes)" if self.ranks > 1 else ")")
        )

    # ------------------------------------------------------------------ iteration
    @property
    def epoch(self) -> float:
        """Epochs done, fractional."""
        return self._epoch + self._position / self.steps_per_epoch

    def next_step(self, rank: int = 0) -> list[MicroBatch]:
        """The micro-batches of the next optimizer step (rank `rank`'s share of them)."""
        if self._position >= self.steps_per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
        plan = self._epoch_plan(self._epoch)
        first = self._position * self.micro_per_step + rank * self.grad_accum
        step = plan[first : first + self.grad_accum]
        self._position += 1
        return [self._build(mb) for mb in step]

    def _epoch_plan(self, epoch: int) -> list[list[int]]:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self._make_plan(epoch))
        return self._plan[1]

    def _make_plan(self, epoch: int) -> list[list[int]]:
        """The micro-batches (lists of sample or row indices) of one epoch."""
        bs, n_micro = self.batch_size, self.steps_per_epoch * self.micro_per_step
        units = len(self._rows) if self._rows is not None else len(self.samples)
        if not self.drop_last:
            n_micro = -(-units // bs)
        order = list(range(units))
        if not self.shuffle:
            return [order[i * bs : (i + 1) * bs] for i in range(n_micro)]
        rng = random.Random(self.seed + epoch)
        rng.shuffle(order)
        order = order[: n_micro * bs]  # whatever does not fill a step waits for a later epoch
        if self._rows is not None:  # packed rows are all max_length: nothing to bucket
            return [order[i * bs : (i + 1) * bs] for i in range(n_micro)]
        window = BUCKET_WINDOW * bs
        micro = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w : w + window], key=self._lengths.__getitem__)
            micro += [chunk[i : i + bs] for i in range(0, len(chunk), bs)]
        rng.shuffle(micro)
        return micro

    def epoch_steps(self, epoch: int = 0) -> Iterator[list[MicroBatch]]:
        """Every step of `epoch` in order, leaving the position of `next_step` alone (an
        evaluation pass over the whole data)."""
        plan = self._make_plan(epoch)
        for i in range(0, len(plan), self.grad_accum):
            yield [self._build(mb) for mb in plan[i : i + self.grad_accum]]

    # ------------------------------------------------------------------ tensors
    def _build(self, units: list[int]) -> MicroBatch:
        if self._rows is not None:
            return self._build_packed([self._rows[u] for u in units])
        if self.parted:
            return self._build_parts(units)
        width = max(self._lengths[i] for i in units)
        ids, labels, real = [], [], []
        for i in units:
            s, n = self.samples[i], self._lengths[i]
            ids.append(s.input_ids[:n] + [self.pad_id] * (width - n))
            labels.append(s.labels[:n] + [IGNORE_INDEX] * (width - n))
            real.append([1] * n + [0] * (width - n))
        # Right padding with causal attention: real tokens never see pads, and the default
        # arange positions are exact, so attention needs no position_ids or mask.
        return MicroBatch(
            _tensor(ids),
            _tensor(labels),
            attention_mask=_padding_mask(real),
            images=self._images([[i] for i in units]),
            **self._per_sample(units),
        )

    def _images(self, rows: list[list[int]]):
        """The pixel inputs of rows holding these samples, in order (None: no images)."""
        if self.pixels is None:
            return None
        return self.pixels(
            [[(self.samples[i].source, self.samples[i].images or ()) for i in row] for row in rows]
        )

    def _build_parts(self, units: list[int]) -> MicroBatch:
        """Each sequence of each sample a row, the samples' first sequences first (TRL's
        concatenated batch: all chosen, then all rejected), right-padded to the longest."""
        rows = [(i, *_part(self.samples[i], j)) for j in range(self.group) for i in units]
        width = max(n for _, _, n in rows)
        place = {i: k for k, i in enumerate(units)}
        ids, labels, slots, real = [], [], [], []
        for i, a, n in rows:
            s, pad = self.samples[i], width - n
            ids.append(s.input_ids[a : a + n] + [self.pad_id] * pad)
            labels.append(s.labels[a : a + n] + [IGNORE_INDEX] * pad)
            slots.append(_slots(s, a, n, place[i], len(units)) + [-1] * pad)
            real.append([1] * n + [0] * pad)
        return MicroBatch(
            _tensor(ids),
            _tensor(labels),
            attention_mask=_padding_mask(real),
            slots=_tensor(slots),
            images=self._images([[i] for i, _, _ in rows]),  # each sequence its sample's images
            **self._per_sample(units),
        )

    def _per_sample(self, units: list[int]) -> dict:
        """The micro-batch's sample indices, extras and the tokens TRL counts where not all."""
        extra = [self.samples[i].extra for i in units]
        counted = [self.samples[i].counted for i in units]
        return dict(
            units=list(units),
            extra=torch.tensor(extra, dtype=torch.float64) if extra[0] else None,
            input_tokens=sum(counted) if counted[0] is not None else None,
        )

    def _build_packed(self, rows: list[list[int]]) -> MicroBatch:
        units = [i for row in rows for i in row]
        ids, labels, pos, docs, real, slots = [], [], [], [], [], []
        k = 0  # the sample's place in the micro-batch
        for row in rows:
            r_ids, r_lab, r_pos, r_doc, r_slot = [], [], [], [], []
            d = 0  # documents in the row so far
            for i in row:
                s = self.samples[i]
                for j in range(self.group):
                    a, n = _part(s, j) if self.parted else (0, self._lengths[i])
                    r_ids += s.input_ids[a : a + n]
                    # The first token of a document is predicted from the previous document's last
                    # token after the engine's shift: never a target.
                    r_lab += [IGNORE_INDEX] + s.labels[a + 1 : a + n]
                    r_pos += range(n)
                    r_doc += [d] * n
                    d += 1
                    if s.slots is not None:
                        r_slot += _slots(s, a, n, k, len(units))
                k += 1
            pad = self.max_length * self.group - len(r_ids)
            real.append([1] * len(r_ids) + [0] * pad)
            r_ids += [self.pad_id] * pad
            r_lab += [IGNORE_INDEX] * pad
            r_pos += range(pad)
            r_doc += [d] * pad  # padding is its own document: attends to nothing real
            ids.append(r_ids)
            labels.append(r_lab)
            pos.append(r_pos)
            docs.append(r_doc)
            slots.append(r_slot + [-1] * pad)
        return MicroBatch(
            _tensor(ids),
            _tensor(labels),
            position_ids=_tensor(pos),
            document_ids=_tensor(docs),
            attention_mask=_padding_mask(real),
            slots=_tensor(slots) if self.samples[units[0]].slots is not None else None,
            images=self._images([[i for i in row for _ in range(self.group)] for row in rows]),
            **(self._per_sample(units) if self.parted else {}),
        )

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """JSON-serialisable position: load it into a Batcher over the same samples and
        settings and the following steps are exactly those an uninterrupted run would see."""
        return {"epoch": self._epoch, "position": self._position, "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        saved = state.get("steps_per_epoch", self.steps_per_epoch)
        if saved != self.steps_per_epoch:
            # The data or batch settings changed: an exact resume is impossible, so keep the
            # same fraction of the epoch rather than replaying or skipping data.
            log.warning(
                "data changed since the checkpoint (%d steps per epoch, now %d): resuming at the same epoch fraction",
                saved,
                self.steps_per_epoch,
            )
            position = round(position * self.steps_per_epoch / max(saved, 1))
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise DataError(f"data loader state out of range: epoch {epoch}, position {position}")
        self._epoch, self._position = epoch, position


def pack_rows(order: list[int], lengths: list[int], max_length: int, open_rows: int) -> list[list[int]]:
    """Lay samples (indices, visited in `order`) into rows of at most max_length tokens.

    First fit over the `open_rows` most recent unfinished rows: a short sample fills a gap
    left in an earlier row instead of starting a new one. open_rows=1 is next fit, which keeps
    the given order exactly. Rows come out in the order they were opened.
    """
    done: list[tuple[int, list[int]]] = []  # (opening index, row)
    open_: list[tuple[int, list[int], int]] = []  # (opening index, row, room left)
    opened = 0
    for i in order:
        n = lengths[i]
        for k, (at, row, room) in enumerate(open_):
            if n <= room:
                row.append(i)
                open_[k] = (at, row, room - n)
                if room == n:  # full: stop scanning it
                    done.append(open_.pop(k)[:2])
                break
        else:
            if len(open_) == open_rows:
                done.append(open_.pop(0)[:2])
            open_.append((opened, [i], max_length - n))
            opened += 1
            if n == max_length:
                done.append(open_.pop()[:2])
    done += [(at, row) for at, row, _ in open_]
    done.sort(key=lambda x: x[0])
    return [row for _, row in done]


def _part(sample: Sample, j: int) -> tuple[int, int]:
    """(first token, length) of sequence `j` of a sample of several."""
    return sum(sample.parts[:j]), sample.parts[j]


def _slots(sample: Sample, a: int, n: int, k: int, units: int) -> list[int]:
    """The micro-batch slots of tokens [a, a + n) of the k-th of `units` samples: code c goes to
    slot c * units + k; the sequence's first token is never a target."""
    return [-1] + [c * units + k if c >= 0 else -1 for c in sample.slots[a + 1 : a + n]]


def _tensor(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _padding_mask(real: list[list[int]]) -> torch.Tensor | None:
    """transformers' attention_mask of right-padded rows, or None where nothing is padding."""
    return None if all(all(r) for r in real) else _tensor(real)
