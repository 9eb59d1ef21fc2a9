"""draftwire: speculative decoding split across the network."""
