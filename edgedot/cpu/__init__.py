"""The CPU implementations of the ops: plain tensor operations over chunks of edges, bounded in
memory and deterministic (every sum in edge order)."""
