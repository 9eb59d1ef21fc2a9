"""The Ray verifier pool: replicas on Ray actors, one gRPC front that pumps each session to one of them."""
