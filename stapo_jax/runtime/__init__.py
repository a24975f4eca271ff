"""Processes and persistence: JAX multi-controller initialisation, Orbax checkpoints and HF export, and the local multi-process launcher."""
