"""Log-probabilities of responses: the forward pass (`logprobs`), packed sequences (`packing`), sequence parallelism and
the batch arithmetic they share."""
