"""The test kit: fakes (an engine, a verifier, a drafter), the verifier in process, the independent
oracles, the planner on a virtual clock. For tests only: not in the wheel (the rig the benchmarks also
stand on is tools/rig)."""
