"""The only package that imports MLX.

MLX's cuDNN attention (MLX_CUDA_USE_CUDNN_SDPA, on by default on CUDA) is left on: the
vision tower uses it at a bounded set of shapes (vision_attention), and prompt attention
keeps MLX's composed ops (composed_attention), so no request waits for a new cuDNN plan.
An operator who sets it to 0 gets MLX's own kernels everywhere.
"""
