"""Generated code of the draftwire.v1 wire contract (proto/draftwire/v1/draftwire.proto)."""
