"""What vlmserve hands MLX as a kernel's source."""


def test_kernel_sources_lose_comments_and_indentation_but_not_quoted_text():
    from vlmserve.engine.ops import cuda_kernels

    source = '    asm("ld.global // a path" : "=r"(v));  // why\n\n    // a whole line\n#pragma unroll\n  int a = 1;\n'
    assert cuda_kernels.compact(source) == 'asm("ld.global // a path" : "=r"(v));\n#pragma unroll\nint a = 1;\n'


def test_the_kernels_stay_off_on_gpus_before_ampere(monkeypatch):
    """Their mma.sync bfloat16 instructions need compute capability 8.0: a Turing or Volta GPU
    keeps MLX's own ops, as does a device that reports no capability."""
    from vlmserve.engine.ops import cuda_kernels

    monkeypatch.setattr(cuda_kernels, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_kernels, "_HAS_KERNEL_API", True)
    monkeypatch.setattr(cuda_kernels, "_SWITCHED_ON", True)
    seen = []
    for info, expected in (
        ({"compute_capability_major": 7}, False),
        ({"compute_capability_major": 9}, True),
        ({}, False),
    ):
        monkeypatch.setattr(cuda_kernels.mx, "device_info", lambda info=info: info)
        cuda_kernels._gpu_supported.cache_clear()
        seen.append(cuda_kernels.enabled() == expected)
    cuda_kernels._gpu_supported.cache_clear()
    assert seen == [True, True, True]
