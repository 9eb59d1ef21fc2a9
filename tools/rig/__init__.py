"""The rig the benchmarks and the thorough tests stand on: `draftwire serve` (and `edge`) in child
processes, a delaying proxy for the network, a local Ray cluster, certificates for TLS, and the
two-device rig (`devices`: the edge and the verifier pinned to cores of their own). Ships in the wheel,
since `draftwire bench` runs on it; the test kit (tools/testkit) and the stress kit (tools/stress) do not.
"""
