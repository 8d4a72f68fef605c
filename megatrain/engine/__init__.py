"""The optimizer step: the layer-streaming sweeps (engine.py), the transport that moves weights
in and gradients out and applies the optimizer (transport.py), the units stepped on the GPU
(gpustep.py), and AdamW on the host state with its learning-rate schedules (optim.py). The
engine computes the loss through an objective (objectives/) and places everything as its
`Plan` (planning/) says."""
