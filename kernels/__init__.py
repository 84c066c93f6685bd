"""radixlm.kernels: Triton kernels, one op per file, each with a plain-torch reference that is
also the CPU path."""

from ._triton import compiled_kernel_count

__all__ = ["compiled_kernel_count"]
