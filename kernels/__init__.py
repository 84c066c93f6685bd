"""radixlm.kernels: Triton kernels, one op per file, each with a plain-torch reference that is
also the CPU path."""
