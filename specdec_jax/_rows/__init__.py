"""Row sources and what every rule shares: per-sequence reads, batching, the residual pass, the
chain skeleton, logprobs."""
