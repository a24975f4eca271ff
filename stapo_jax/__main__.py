"""``python -m stapo_jax`` is the ``stapo-jax`` command."""
import sys

from stapo_jax.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
