import sys
import time

import torch

sys.path.insert(0, ".")
from megatrain.planning import probe
from megatrain.planning.placement import optimizer_threads

t = optimizer_threads(1)
torch.set_num_threads(t)


def old(numel=32 * 2**20):
    p, g, m, v = (torch.rand(numel) for _ in range(4))
    steps = [torch.tensor(1.0)]

    def once():
        t0 = time.perf_counter()
        torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            steps,
            amsgrad=False,
            lr=1e-5,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
        )
        return time.perf_counter() - t0

    once()
    return numel / min(once() for _ in range(3))


for _ in range(3):
    print(
        f"threads {t} old(rand) {old() / 1e9:.2f} G/s  new(fill) {probe._adam_rate(32 * 2**20) / 1e9:.2f} G/s  new 128M {probe._adam_rate(128 * 2**20) / 1e9:.2f} G/s",
        flush=True,
    )
