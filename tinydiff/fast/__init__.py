"""Decoding without launch overhead: each fast path (compiled steps, one-graph rounds, FR-Spec's pruned
draft head) beside the plain loop it speeds up, with a test that they give the same tokens.
A wing: it imports the core, never the reverse."""
