"""radixlm.kernels: Triton kernels, one op per file, each with a plain-torch reference that is
also the CPU path."""

from ._triton import compiled_kernel_count, compiled_kernel_variants

__all__ = ["compiled_kernel_count", "compiled_kernel_variants"]
