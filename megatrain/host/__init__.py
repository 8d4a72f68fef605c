"""The model in host memory: the fp32 master weights and AdamW moments of every unit (state.py),
the page-aligned, page-locked buffers they and the parked activations live in (hostmem.py), and
the activations parked there between the sweeps (activations.py). Everything above reads or
writes the run's state through this package."""
