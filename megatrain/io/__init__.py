"""Files in and out: Hugging Face weights read and written (weights.py, reader.py, with MXFP4
decoding from models/), resumable checkpoints (checkpoint.py), the partitioned checkpoints and
models of a world spanning machines (partition.py), atomic writing and sharding (writing.py),
the manifests that make a directory verifiable (manifest.py), and a run's output directory
(outputs.py)."""
