"""The edge: a llama.cpp drafter, the session client that talks to the verifier, and the chat app."""
