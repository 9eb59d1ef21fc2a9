"""The kits around the product: benchmarks (bench), the rig they stand on (rig), the load test, model
fetching and building (models); and, not in the wheel, the stress kit (stress: fuzz, soak) and the test
kit (testkit). The `draftwire` command itself is draftwire_cli."""
