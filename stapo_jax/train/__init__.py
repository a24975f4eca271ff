"""The RL and SFT loops: experience building, batching and packing, the jitted train step and mini-batch update, optimizer, metrics and run files."""
