"""stapo_jax: STAPO RL fine-tuning of Qwen3 in JAX/Flax."""
__version__ = "0.1.0"
