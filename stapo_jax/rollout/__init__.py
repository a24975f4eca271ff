"""Rollouts: a JetStream 0.2.2 engine over the Flax Qwen3, the in-process driver, and gRPC serving.

Import ``stapo_jax.rollout.compat`` before any ``jetstream`` module (the engine and server modules do).
"""
