"""The verifier: verification rules, the transformers target engine, sessions and the gRPC servicer."""
