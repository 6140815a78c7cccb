"""What vlmserve hands MLX as a kernel's source."""


def test_kernel_sources_lose_comments_and_indentation_but_not_quoted_text():
    from vlmserve.engine.ops import cuda_kernels

    source = '    asm("ld.global // a path" : "=r"(v));  // why\n\n    // a whole line\n#pragma unroll\n  int a = 1;\n'
    assert cuda_kernels.compact(source) == 'asm("ld.global // a path" : "=r"(v));\n#pragma unroll\nint a = 1;\n'
