"""The top floor: the `draftwire` command, the demo, benchmarks, the load test, model building, test kits."""
