"""Token masks beyond the built-in ones of :mod:`stapo_jax.algo.masks`, one module each: a module here registers
its mask with ``stapo_jax.algo.masks.register_token_mask`` (with ``settings_cls=`` / ``section=`` for settings of
its own, read from that run-config section: :mod:`stapo_jax.config.extensions`) and ``masks.TOKEN_MASKS`` finds it
(it imports every module of this package before a lookup), so ``actor.token_mask: <name>`` selects it from YAML."""
