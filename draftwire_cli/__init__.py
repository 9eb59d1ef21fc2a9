"""The `draftwire` command (draftwire_cli.main), the product's top floor: it builds the typed configs from
the flags and runs the edge, the verifier, the pool and the tools below it."""
