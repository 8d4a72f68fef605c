"""Reinforcement learning's rollouts (stage grpo): completions sampled from the policy as it
trains, each from a random stream of its own (`sampling`), by a model of the policy on the device
whose last layers may stream through it (`policy`), scored by reward functions (`rewards`) and
turned into the micro-batches the GRPO objective trains on (`rollout`); or sampled one step ahead
by the weights of the step before (`offpolicy`)."""
