"""User-facing commands: the CLI, eval, demo/chat, plan, check/dump for PyTorch parity, plots."""
