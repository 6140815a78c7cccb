"""The few-row matmul (few_row_matmul.py) over an affine-quantized weight: 4 or 8 bits, groups
of 32, 64 or 128, bf16 or fp16 scales and biases, as MLX's QuantizedLinear stores them.

MLX's quantized matmul for a decode step's 2-32 rows is a general tiled GEMM on CUDA, dear
to launch and to run at that size. Here the loop of the dense kernel stays, with smaller
loads: each lane reads the 8 codes of its two weight rows for a chunk of 32 inputs (one
32-bit word at 4 bits, two at 8), turns them into mma operands exactly, and the chunk's
partial dot product is scaled in float32:

    y[m, n] += scale[n, g] * sum_k x[m, k] * q[n, k]  +  bias[n, g] * sum_k x[m, k]

for the chunk's group g, as MLX's own quantized kernels compute it. Codes become operands by
bit pattern: `MAGIC | q` is the number OFF + q in bf16 (128 + q) or fp16 (1024 + q), exact, and
the OFF * sum_k x[m, k] it adds is taken out with the bias (bias - OFF * scale). 8-bit codes in
bf16 (256 values do not fit one exponent) are converted instead. The sums of x per row and
chunk come from one more mma against ones, already in the output's fragment layout.
"""

from __future__ import annotations

import copy
import logging
import math

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_matmul as dense

log = logging.getLogger(__name__)

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

_QUANTIZED_LOOP = """    constexpr int WPR = K * BITS / 32;               // 32-bit words per weight row
    constexpr int GPR = K / GS;                      // groups per weight row
    constexpr int WPL = BITS / 4;                    // words per lane and row in a chunk
    const uint32_t* wq = reinterpret_cast<const uint32_t*>(w);
    // W is read once: past L1 (which keeps X, read by every block).
    auto stream = [](const uint32_t* p) {
        uint32_t v;
        asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
        return v;
    };
    // Two codes as one mma operand register: OFF + q in T, exactly.
    auto pair = [](uint32_t lo, uint32_t hi) -> uint32_t {
        if constexpr (MAGIC != 0) {
            return (uint32_t)MAGIC | lo | (hi << 16);
        } else {
            const T l = static_cast<T>((float)lo), h = static_cast<T>((float)hi);
            return (uint32_t)(*reinterpret_cast<const unsigned short*>(&l))
                | ((uint32_t)(*reinterpret_cast<const unsigned short*>(&h)) << 16);
        }
    };
    // The codes k..k+7 of one row, from its WPL words, as four operand registers (pairs of k).
    auto operands = [&](const uint32_t (&v)[WPL], uint32_t (&p)[4]) {
        constexpr uint32_t MASK = (1u << BITS) - 1;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int lo = 2 * j * BITS, hi = lo + BITS;
            p[j] = pair((v[lo / 32] >> (lo % 32)) & MASK, (v[hi / 32] >> (hi % 32)) & MASK);
        }
    };
    const T one_t = static_cast<T>(1.f);
    const uint32_t one_bits = *reinterpret_cast<const unsigned short*>(&one_t);
    const uint32_t ones = one_bits | (one_bits << 16);
    for (int kc0 = warp; kc0 < KC; kc0 += U * WARPS) {
        uint32_t a[U][F][2][WPL];
        float sc[U][F][2], bi[U][F][2];
        uint4 b[U][MT];
        #pragma unroll
        for (int u = 0; u < U; ++u) {                // issue every load of U chunks first, unbranched:
            const bool live = kc0 + u * WARPS < KC;  // out-of-range chunks and rows read a valid
            const int kc = live ? kc0 + u * WARPS : kc0;  // address and count for nothing
            const int group = kc * 32 / GS;
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const size_t n = n0 + f * 16 + h * 8 + g;
                    #pragma unroll
                    for (int i = 0; i < WPL; ++i) a[u][f][h][i] = stream(wq + n * WPR + kc * BITS + c * WPL + i);
                    const float s = static_cast<float>(scales[n * GPR + group]);
                    sc[u][f][h] = live ? s : 0.f;
                    bi[u][f][h] = live ? static_cast<float>(biases[n * GPR + group]) - OFF * s : 0.f;
                }
            #pragma unroll
            for (int t = 0; t < MT; ++t) {
                const int row = t * 8 + g;
                b[u][t] = __ldg(xv + ((size_t)(row < M ? row : M - 1) * K + kc * 32) / 8 + c);
                if (!live || row >= M) b[u][t] = zero;
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u)
            #pragma unroll
            for (int t = 0; t < MT; ++t) {
                // sum_k x over the chunk for rows t*8 + 2c and 2c+1: every row of ones @ X^T.
                float xs[4] = {0.f, 0.f, 0.f, 0.f};
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%6}, {%0,%1,%2,%3};"
                    : "+f"(xs[0]), "+f"(xs[1]), "+f"(xs[2]), "+f"(xs[3]) : "r"(ones), "r"(b[u][t].x), "r"(b[u][t].y));
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%6}, {%0,%1,%2,%3};"
                    : "+f"(xs[0]), "+f"(xs[1]), "+f"(xs[2]), "+f"(xs[3]) : "r"(ones), "r"(b[u][t].z), "r"(b[u][t].w));
                #pragma unroll
                for (int f = 0; f < F; ++f) {
                    uint32_t p0[4], p1[4];           // rows g and g+8 of this feature tile
                    operands(a[u][f][0], p0);
                    operands(a[u][f][1], p1);
                    float d[4] = {0.f, 0.f, 0.f, 0.f};
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                        : "r"(p0[0]), "r"(p1[0]), "r"(p0[1]), "r"(p1[1]), "r"(b[u][t].x), "r"(b[u][t].y));
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                        : "r"(p0[2]), "r"(p1[2]), "r"(p0[3]), "r"(p1[3]), "r"(b[u][t].z), "r"(b[u][t].w));
                    #pragma unroll
                    for (int r = 0; r < 4; ++r)  // d[r]: feature g + 8 (r >> 1), row 2c + (r & 1)
                        acc[f][t][r] += sc[u][f][r >> 1] * d[r] + bi[u][f][r >> 1] * xs[r & 1];
                }
            }
    }
"""

# (MAGIC, OFF) per (activation dtype, bits): see the module's docstring.
_CODES = {
    (mx.bfloat16, 4): (0x43004300, 128),
    (mx.float16, 4): (0x64006400, 1024),
    (mx.float16, 8): (0x64006400, 1024),
    (mx.bfloat16, 8): (0, 0),
}


# Layer settings checked on this device (verify): (N, K, bits, group, dtypes, bias, 8-row tiles) -> passed.
_CHECKED: dict[tuple, bool] = {}


def _dims(layer: nn.Module) -> tuple[int, int]:
    """(N, K) of a quantized layer: its codes are packed 32 // bits to a uint32."""
    w = layer["weight"]
    return w.shape[0], w.shape[1] * 32 // layer.bits


def _fits(layer: nn.Module, dtype: mx.Dtype) -> bool:
    """A layer the kernel is built for, with activations of `dtype`."""
    if getattr(layer, "mode", "affine") != "affine" or "biases" not in layer:
        return False
    w, scales = layer["weight"], layer["scales"]
    bits, group = getattr(layer, "bits", None), getattr(layer, "group_size", None)
    if bits not in BITS or group not in GROUP_SIZES or w.ndim != 2 or w.dtype != mx.uint32:
        return False
    n, k = _dims(layer)
    if n % 16 or k % group or dtype not in dense.MMA_TYPES or scales.shape != (n, k // group):
        return False
    return dense.bias_served(layer.get("bias", None), n, dtype)


def _setting(layer: nn.Module, dtype: mx.Dtype, rows: int) -> tuple:
    tiles = dense.row_tiles(rows)
    return (*layer["weight"].shape, layer.bits, layer.group_size, dtype, layer["scales"].dtype, "bias" in layer, tiles)


def serves_layer(layer: nn.Module, x: mx.array) -> bool:
    """An affine-quantized nn.QuantizedLinear / QuantizedEmbedding the kernel takes for input x:
    one whose setting `verify` checked on this device."""
    if not dense.enabled() or not _fits(layer, x.dtype) or not dense.rows_served(x, _dims(layer)[1]):
        return False
    return _CHECKED.get(_setting(layer, x.dtype, math.prod(x.shape[:-1]))) is True


def verify(module: nn.Module) -> tuple[int, int]:
    """Check the kernel once per quantized layer setting under `module`, at both tile counts,
    against x @ dequantize(W).T in float32 (activations in the scales' dtype, as a quantized
    model runs); only settings that pass are served. On the MLX thread, before any decode step
    is compiled. Returns (layers' settings passed, refused), counted per layer."""
    for layer, dtype, rows in pending(module):
        check(layer, dtype, rows)
    outcomes = [_CHECKED[_setting(layer, dtype, rows)] for layer, dtype, rows in _candidates(module)]
    return sum(outcomes), len(outcomes) - sum(outcomes)


def pending(module: nn.Module) -> list[tuple[nn.Module, mx.Dtype, int]]:
    """The settings under `module` not checked yet, one (layer, activation dtype, rows) each: a
    build (~1 s of JIT on CUDA, never cached on disk by MLX) and a check apiece (`check`)."""
    todo, seen = [], set()
    for layer, dtype, rows in _candidates(module):
        setting = _setting(layer, dtype, rows)
        if setting not in _CHECKED and setting not in seen:
            seen.add(setting)
            todo.append((layer, dtype, rows))
    return todo


def check(layer: nn.Module, dtype: mx.Dtype, rows: int) -> bool:
    """Build and check this layer's setting at `rows` (once); until then MLX's matmul serves it."""
    setting = _setting(layer, dtype, rows)
    if setting not in _CHECKED:
        _CHECKED[setting] = _agrees(layer, dtype, rows)
        if not _CHECKED[setting]:
            log.warning("the quantized few-row kernel disagrees for %s: MLX's matmul serves it", setting)
    return _CHECKED[setting]


def _candidates(module: nn.Module):
    """(layer, activation dtype, rows) for every quantized layer under `module` the kernel fits,
    at both tile counts."""
    if not dense.enabled():
        return
    for name, layer in module.named_modules():
        # A fused projection's own parts (`_alone`) serve only inputs a decode step never gives them.
        if not isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or "_alone" in name.split("."):
            continue
        dtype = layer["scales"].dtype
        if _fits(layer, dtype):
            for rows in (dense.MIN_ROWS, dense.MAX_ROWS):
                yield layer, dtype, rows


def _agrees(layer: nn.Module, dtype: mx.Dtype, rows: int) -> bool:
    """The kernel build this layer takes at `rows`, run on its first output features (up to eight
    blocks' worth: N is a launch size, not part of the build), against the float32 reference."""
    n, k = _dims(layer)
    x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(dtype)
    shape = launch_shape(x, n, k)
    part = copy.copy(layer)
    part.update({name: v[: min(n, 16 * shape[1] * 8)] for name, v in layer.items() if isinstance(v, mx.array)})
    w = mx.dequantize(part["weight"], part["scales"], part["biases"], layer.group_size, layer.bits)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    if "bias" in part:
        ref = ref + part["bias"].astype(mx.float32)
    try:
        ours = matmul(part, x, shape).astype(mx.float32)
        scale = mx.abs(ref).max()
        return bool(mx.all(mx.abs(ours - ref) <= 1e-2 * scale + 1e-2 * mx.abs(ref)).item())
    except Exception:  # noqa: BLE001 - a build or launch this device refuses: MLX's matmul serves it
        log.warning("the quantized few-row kernel failed to run on this device", exc_info=True)
        return False


def matmul(layer: nn.Module, x: mx.array, shape=None) -> mx.array:
    """x (..., K) @ dequantized(layer.weight).T (+ layer.bias) for a layer `serves_layer` accepts."""
    n, k = _dims(layer)
    bias = layer.get("bias", None)
    names = ("x", "w", "scales", "biases")
    kernel = dense.build("vlmserve_few_row_qmm", _QUANTIZED_LOOP, dense.MMA_TYPES[x.dtype], names, bias is not None)
    magic, off = _CODES[(x.dtype, layer.bits)]
    inputs = [x, layer["weight"], layer["scales"], layer["biases"]] + ([bias] if bias is not None else [])
    template = [("BITS", layer.bits), ("GS", layer.group_size), ("MAGIC", magic), ("OFF", off)]
    return dense.launch(kernel, x, inputs, n, k, template, shape or launch_shape(x, n, k))


def launch_shape(x: mx.array, n: int, k: int) -> tuple[int, int, int, int]:
    """(MT, F, WARPS, U) as in few_row_matmul.launch_shape, chosen by the kernel's time per call
    on the H100 (benchmarks/few_row_probe.py) for a 2B model's layers at 8 and 32 rows: four
    feature tiles per warp for wide layers, 16 warps for deep ones, two of each otherwise.
    16 warps take one tile and one chunk in flight: more asked too many registers for a
    512-thread block (the launch failed)."""
    mt = dense.row_tiles(math.prod(x.shape[:-1]))
    if n >= 8192:
        return mt, next(f for f in (4, 2, 1) if n % (16 * f) == 0), 4, 1
    if k >= 4096:
        return mt, 1, 16, 1
    return mt, 2 if n % 32 == 0 else 1, 8, 2
