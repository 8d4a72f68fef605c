"""Where every byte of a run lives, decided before anything is allocated: the plan's data
(planspec.py), the memory model (footprint.py), the step-time model (costmodel.py), the device
probe that measures a layer (probe.py), the decisions themselves and the machine's budgets,
its CPU optimizer threads included (placement.py), and the record of what the plan predicted
beside what the run measured (memory.py). The engine and transport carry a `Plan` out; they
keep no rules of their own. plan.py, at the top, turns a training config into the plan's inputs
(`megatrain plan`, the trainer's preflight)."""
