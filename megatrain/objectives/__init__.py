"""Training objectives: what a step's loss is, computed from the last hidden states a chunk of
tokens at a time, and its gradient, which the engine carries back through the layers.

* base.py: `Objective`, what the engine calls. For each micro-batch `targets` (what the loss
  needs of it, moved to the device once) and `count` (its share of the step's normaliser, which
  the engine sums over micro-batches and ranks); after the forward sweep, with every micro-batch's
  last hidden states at once, `loss_and_grads` (the loss and its gradient w.r.t. those states) or,
  forward only, `loss_sum` (evaluation).
* losshead.py: `Head`, the loss head bound to its weights: final norm and LM head over at most
  `chunk` tokens at once (`forward`: logits, no gradients; `backward`: a loss term per chunk
  differentiated w.r.t. the chunk's hidden states and the head's own weights).
* cross_entropy.py: `CrossEntropy`, the causal language model's loss (supervised fine-tuning),
  the default of `runtime.build_model`.
* preference.py: the preference losses (TRL's dpo loss types, kto, orpo, simpo) over
  per-sequence sums, their config and metrics; sequence_sums.py: `Preference`, the objective that
  computes those sums a chunk at a time and sends each token its gradient (below).

A new stage adds an objective here and passes it to `build_model(objective=...)`; the engine and
the transport stay as they are, because the interface is cut where every such loss meets the
model: per-token log-probabilities of the targets, taken from the logits of a chunk, and a
gradient that flows back into the hidden states token by token.

* Preference optimisation (DPO, built: sequence_sums.py): `targets` carries the shifted labels (the completion's tokens),
  each token's sequence, the pairing of chosen and rejected sequences and the reference model's
  summed log-probabilities of each (from a forward-only pass of the reference weights, made
  before the step); `count` is the pairs. The loss couples all tokens of a pair, so
  `loss_and_grads` takes two passes over the head: `forward` for each sequence's summed
  log-probability, then the loss and its derivative w for each sequence (a closed form of the
  log-sigmoid of the margins), then `backward` with each chunk's term the sum of w times each
  token's log-probability, which sends every token its gradient. A step's micro-batches arrive
  together, so a pair may span micro-batches, not ranks (each rank's loss is its own pairs').
* Group-relative policy optimisation (GRPO, built: grpo.py): `targets` carries per-token advantages, the
  sampling policy's log-probabilities (the ratio's denominator), a reference model's where a KL
  term is wanted, and the mask of generated tokens; `count` the tokens (or sequences) the loss is
  averaged over. Every term is per token, so one `backward` pass computes it chunk by chunk; TRL's
  correction of a stale sampler (offpolicy.py) adds the sampler's log-probs, and where it weights
  a completion as a whole (or masks it) one `forward` pass first.
* REINFORCE leave-one-out (RLOO, built: rloo.py): GRPO's micro-batches, a loss per completion
  over its summed log-probs, so two passes over the head, as the preference losses take.

Neither needs the full logits, a second backward sweep or anything new from the engine; what they
add is data (fields of the micro-batch the data pipeline fills) and their objective.
"""
