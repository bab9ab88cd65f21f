"""Kernels for the paged KV cache: Triton kernels, CPU kernels in C, and their pure-torch twins.

Every kernel family has a launcher here and a reference in `kernels.reference` with the same
signature. The engine picks one set through `kernels.backend.get_kernel_ops(name)`.
"""
