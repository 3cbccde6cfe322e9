"""The embedded speculative decoder: the decode loop, the draft chain as CUDA graphs, batch-1 chain attention."""
