"""The Ray verifier pool: replicas, session routing, scaling, recovery (to come)."""
