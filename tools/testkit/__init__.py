"""Kits for tests and benchmarks: a verifier in a child process, a delaying proxy, fakes."""
