"""Policy losses beyond ``vanilla``, one module each: a module here registers its loss with
``stapo_jax.algo.objectives.register_policy_loss`` (with ``settings_cls=`` / ``section=`` for settings of its own,
read from that run-config section, ``actor.<name>`` by convention: :mod:`stapo_jax.config.extensions`) and
``objectives.POLICY_LOSSES`` finds it (it imports every module of this package before a lookup), so
``actor.policy_loss: <name>`` selects it from YAML."""
