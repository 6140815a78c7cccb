"""Write a standalone CUDA program that times the few-row decode kernels on the GPU alone.

`few_row_probe.py` times the kernels through MLX, where each call also pays MLX's host cost
(~15-20 µs on an H100, more than a small layer's kernel takes). This writes the kernels'
sources (engine/ops/few_row_matmul.py, few_row_quantized.py, as MLX builds them) into one .cu
file with a main() that, for each layer shape of a Qwen2-VL-2B decode step, launches the dense
bf16 kernel and the 4-bit (group 64) kernel over 28 copies of the weight in turn, as a step
reads them, and prints µs per call and the bytes of weight read per second. Build it with nvcc:

    python benchmarks/few_row_cuda.py few_row.cu --rows 8,32
    nvcc -O3 -arch=sm_90 -std=c++17 few_row.cu -o few_row && ./few_row

`--shapes` lists extra launch shapes (F,WARPS,U) of the quantized kernel to time beside
`few_row_quantized.launch_shape`'s choice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

COPIES = 28  # weight copies of each layer shape timed in turn (the tied logits: one)

_HEADER = r"""#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
struct Shape { int d[4]; __device__ int operator[](int i) const { return d[i]; } };
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
static uint64_t seed = 1;
static float urand() {
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((seed >> 33) % 100000) / 100000.f;
}
template <typename T> T* upload(const std::vector<T>& h) {
  T* d; CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename F> float us_per_call(F launch, int copies, int reps) {
  launch(0);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    printf("   launch failed: %s\n", cudaGetErrorString(e));
    return -1.f;
  }
  for (int i = 0; i < copies; ++i) launch(i);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int r = 0; r < reps; ++r) for (int i = 0; i < copies; ++i) launch(i);
  cudaEventRecord(b); CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
  float ms; cudaEventElapsedTime(&ms, a, b); return ms * 1000.f / (reps * copies);
}
"""


def _source(module: str, name: str) -> str:
    text = (ROOT / "src/vlmserve/engine/ops" / module).read_text()
    start = text.index(f'{name} = """') + len(f'{name} = """')
    return text[start : text.index('"""', start)]


def _kernel(name: str, loop: str, params: str, template: str) -> str:
    body = _source("few_row_matmul.py", "PROLOGUE") + loop + _source("few_row_matmul.py", "EPILOGUE")
    body = body.replace("{mma}", "bf16").replace("{bias}", "")
    return (
        f"template <{template}>\n__global__ void {name}({params}, __nv_bfloat16* y, int x_ndim, Shape x_shape) {{\n"
        f"  using T = __nv_bfloat16;\n{body}\n}}\n"
    )


def _layer_block(name: str, n: int, k: int, runs: list[tuple[str, int, tuple[int, int, int, int]]], vec: int) -> str:
    """Allocate one layer shape's copies, then time each (kind, rows, (MT, F, WARPS, U))."""
    copies = 1 if name == "logits" else COPIES
    code = f"""  {{
    const int N = {n}, K = {k}, C = {copies};
    std::vector<uint32_t> hw((size_t)N * K / 8);
    std::vector<__nv_bfloat16> hs((size_t)N * K / 64), hb(hs.size()), hd((size_t)N * K), hx(64 * K);
    for (auto& v : hw) v = (uint32_t)(urand() * 4294967295.0);
    for (auto& v : hs) v = __float2bfloat16(0.01f + 0.02f * urand());
    for (auto& v : hb) v = __float2bfloat16(-0.1f);
    for (auto& v : hd) v = __float2bfloat16(urand() - 0.5f);
    for (auto& v : hx) v = __float2bfloat16(urand() * 2 - 1);
    std::vector<uint32_t*> wq(C); std::vector<__nv_bfloat16*> sc(C), bi(C), wd(C);
    for (int i = 0; i < C; ++i) {{ wq[i] = upload(hw); sc[i] = upload(hs); bi[i] = upload(hb); wd[i] = upload(hd); }}
    __nv_bfloat16 *x = upload(hx), *y; CK(cudaMalloc(&y, 64 * (size_t)N * 2));
"""
    for kind, rows, (mt, f, warps, u) in runs:
        grid, block = f"N / (16 * {f})", 32 * warps
        if kind == "dense":
            call = f"dense<K, {mt}, {f}, {warps}, {u}><<<{grid}, {block}>>>(x, wd[i], y, 2, xs)"
            bytes_per_weight = 2.0
        else:
            call = (
                f"quantized<K, {mt}, {f}, {warps}, {u}, 4, 64, 0x43004300u, 128, {vec}><<<{grid}, {block}>>>"
                "(x, wq[i], sc[i], bi[i], y, 2, xs)"
            )
            bytes_per_weight = 0.5 + 4 / 64  # codes, and a bf16 scale and bias per 64
        label = f"{name:8s} rows={rows:2d} {kind:9s} MT={mt} F={f} WARPS={warps:2d} U={u}"
        code += f"""    {{
      Shape xs{{{{{rows}, 1, K, 0}}}};
      float us = us_per_call([&](int i) {{ {call}; }}, C, 20);
      if (us > 0) printf("{label}: %7.2f us/call %7.1f GB/s\\n", us, (double)N * K * {bytes_per_weight} / us / 1e3);
    }}
"""
    freed = "cudaFree(wq[i]); cudaFree(sc[i]); cudaFree(bi[i]); cudaFree(wd[i]);"
    return code + f"    for (int i = 0; i < C; ++i) {{ {freed} }}\n    cudaFree(x); cudaFree(y);\n  }}\n"


def main() -> None:
    import mlx.core as mx

    from few_row_probe import QWEN2_VL_2B  # the layer shapes of a Qwen2-VL-2B decode step
    from vlmserve.engine.ops import few_row_matmul, few_row_quantized

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the .cu file to write")
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--shapes", default="", help="extra quantized launch shapes, e.g. 1,8,1;4,4,1")
    args = parser.parse_args()
    extra = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
    quantized_params = (
        "const __nv_bfloat16* x, const uint32_t* w, const __nv_bfloat16* scales, const __nv_bfloat16* biases"
    )
    source = _HEADER
    source += _kernel(
        "dense",
        _source("few_row_matmul.py", "_DENSE_LOOP"),
        "const __nv_bfloat16* x, const __nv_bfloat16* w",
        "int K, int MT, int F, int WARPS, int U",
    )
    source += _kernel(
        "quantized",
        _source("few_row_quantized.py", "_QUANTIZED_LOOP"),
        quantized_params,
        "int K, int MT, int F, int WARPS, int U, int BITS, int GS, uint32_t MAGIC, int OFF, int VEC",
    )
    source += "int main() {\n"
    for name, n, k in QWEN2_VL_2B:
        runs = []
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.zeros((rows, 1, k))
            chosen = few_row_quantized.launch_shape(x, n, k)
            runs.append(("dense", rows, few_row_matmul.launch_shape(rows, n, k)))
            runs.append(("quantized", rows, chosen))
            runs += [("quantized", rows, (chosen[0], *shape)) for shape in extra if n % (16 * shape[0]) == 0]
        source += _layer_block(name, n, k, runs, few_row_quantized.VEC)
    Path(args.out).write_text(source + "  return 0;\n}\n")


if __name__ == "__main__":
    main()
