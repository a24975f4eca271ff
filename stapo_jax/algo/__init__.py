"""The pure algorithm: advantages, token masks (S2T and peers), policy losses, log-probs and entropies, diagnostics, registries and recipes. No I/O, no devices beyond jnp."""
