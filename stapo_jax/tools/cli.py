"""``stapo-jax`` command line: one subcommand per task, each implemented as ``main(argv) -> int`` in its module.

Subcommands are imported lazily so that ``stapo-jax check`` does not pay for JetStream or the trainer.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

COMMANDS = {
    "train": ("stapo_jax.train.trainer", "RL training (STAPO and baselines) from a YAML config"),
    "sft": ("stapo_jax.train.sft", "supervised warm-up with a cross-entropy objective"),
    "eval": ("stapo_jax.tools.evaluate", "benchmark evaluation (avg@k, pass@k) with the rollout engine"),
    "serve": ("stapo_jax.rollout.server", "JetStream gRPC rollout server on 127.0.0.1"),
    "check": ("stapo_jax.tools.check", "recompute a dumped PyTorch batch and compare losses/metrics"),
    "plot": ("stapo_jax.train.plots", "PNG curves of a run; several runs: overlaid, one figure per metric"),
    "compare": ("stapo_jax.train.plots", "the same as plot with two or more runs (e.g. STAPO next to GRPO)"),
    "plan": ("stapo_jax.tools.plan", "per-device memory and FLOPs of a run, without allocating weights"),
    "demo": ("stapo_jax.tools.demo", "load or build a Qwen3 and greedy-decode a prompt"),
    "launch": ("stapo_jax.runtime.launch", "run a command as N local JAX processes (rehearse a pod/SLURM job)"),
}


def quiet_third_party_startup() -> None:
    """Silence the start-up lines every command printed, before the subcommand imports jax / transformers:

    * JAX's INFO lines, e.g. ``INFO jax._src.xla_bridge: Unable to initialize backend 'tpu': ... libtpu.so ...``
      (JAX probes for a TPU on every machine) and ``INFO jax._src.compilation_cache: Resetting cache at
      <empty>.`` (every start, issue 43), shown once a command configures INFO logging: the ``jax`` logger is
      raised to WARNING (a real backend failure is still reported);
    * transformers' ``PyTorch was not found...`` advice (``make run`` installs no torch; only the HF export's
      ``from_pretrained`` needs it): ``TRANSFORMERS_NO_ADVISORY_WARNINGS=1`` unless the user set it.

    Returns None; never raises. Source: JAX's ``jax._src.xla_bridge`` logger and HF transformers'
    ``TRANSFORMERS_NO_ADVISORY_WARNINGS`` environment variable.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("jax").setLevel(logging.WARNING)


def _usage() -> str:
    lines = ["usage: stapo-jax COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`stapo-jax COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv[0]`` to its module's ``main(argv[1:])``; returns the process exit code.

    ``argv`` a list of str; returns an int exit code (0 ok, 2 unknown command or bad input, 130 interrupted:
    a KeyboardInterrupt is one line, no traceback). ValueError
    / FileNotFoundError / NotADirectoryError / IsADirectoryError / PermissionError (EACCES / EPERM; the message
    names the path) / ``stapo_jax.core.errors.CheckpointError``
    (a checkpoint that cannot be restored) of a subcommand are printed as one line (exit 2), not raised; other
    errors propagate. Called as the process entry point (``argv`` None), it first re-executes
    the process under TCMalloc where ``STAPO_JAX_ALLOCATOR`` asks for it (``stapo_jax.runtime.allocator``); a
    bad value of that variable is one line, exit 2; SIGTERM then interrupts like SIGINT (a command may install
    its own stop, ``runtime.stopping``) and a process of ``stapo-jax launch`` stops when its launcher dies. As the
    entry point, the process then ends within 120 s
    whatever thread or child process is left (``runtime.watchdog.arm_exit_guard``). Source: the git-style
    ``COMMAND [ARGS...]`` CLI convention.
    """
    entry_point = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"stapo-jax: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if entry_point:
        from stapo_jax.runtime.allocator import AllocatorError, use_tcmalloc

        try:
            use_tcmalloc()
        except AllocatorError as e:
            print(f"stapo-jax {name}: error: {e}", file=sys.stderr)
            return 2
    quiet_third_party_startup()
    if entry_point:  # SIGTERM = SIGINT until a command installs its own stop (train, sft); a dead launcher stops it
        from stapo_jax.runtime.stopping import interrupt_on_sigterm, watch_launcher_from_env

        interrupt_on_sigterm()
        watch_launcher_from_env()
    code = 1  # an exception below
    try:
        module = importlib.import_module(COMMANDS[name][0])
        code = int(module.main(rest) or 0)
        return code
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) outside a command's own stop handling: one line
        from stapo_jax.runtime.stopping import EXIT_INTERRUPTED, say

        say(f"stapo-jax {name}: stopped by {e.args[0] if e.args else 'SIGINT'} (exit {EXIT_INTERRUPTED})")
        code = EXIT_INTERRUPTED
        return code
    except Exception as e:
        # bad input (ConfigError, DataError, a file where a directory belongs, a damaged checkpoint: a
        # CheckpointError is a ValueError): one line.
        bad_input = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
        if not isinstance(e, bad_input):
            raise
        print(f"stapo-jax {name}: error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 2
        return 2
    finally:
        if entry_point:  # the process ends even if a thread or child process would keep it alive (issue 34)
            from stapo_jax.runtime.watchdog import arm_exit_guard

            arm_exit_guard(code)


if __name__ == "__main__":
    sys.exit(main())
