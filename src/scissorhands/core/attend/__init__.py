"""New tokens through a layer: a chunk streamed, the prefill modes, a block of queries tile by tile."""
