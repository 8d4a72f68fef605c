"""The reward of bench/grpo.py: the parity of a completion's token sum (random weights make any
completion; this one only has to differ within a group, so advantages and the loss are not zero)."""


def parity(completion_ids, **_) -> list[float]:
    return [float(sum(ids) % 2) for ids in completion_ids]
