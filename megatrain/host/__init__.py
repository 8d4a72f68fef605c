"""The model in host memory: the fp32 master weights, held as two 16-bit halves whose bf16 one the
fetches read as it is (split.py, the one rounding of fp32 to bf16), and the AdamW moments of
every unit (state.py); the page-aligned, page-locked buffers they and the parked activations live
in (hostmem.py), the activations parked there between the sweeps (activations.py), and, past host
memory, the disk tier that holds the last units' moments in a file (disk.py, its file
tierfile.py). Everything above reads or writes the run's state through this package."""
