"""Side-by-side benchmarks: ours and a peer in ONE run on the same machine, reported as a
ratio (these machines are noisy; absolute numbers only mean something on a GPU)."""
