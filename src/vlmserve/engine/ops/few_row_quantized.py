"""The few-row matmul (few_row_matmul.py) over an affine-quantized weight: 4 or 8 bits, groups
of 32, 64 or 128, bf16 or fp16 scales and biases, as MLX's QuantizedLinear stores them.

MLX's quantized matmul for a decode step's 2-64 rows is a general tiled GEMM on CUDA, dear
to launch and to run at that size. Here the dense kernel's structure stays (warps split K,
tensor-core `mma.sync`, a fixed-order reduction), and each lane turns the codes it loaded into
weights before the multiply:

    w[n, k] = scale[n, g] * q[n, k] + bias[n, g]     (g: k's group; rounded once to bf16/fp16)

as `mx.dequantize` does. The four lanes that share a weight row read 8 bytes each, side by side
(one 32-byte sector a row; a lane's codes lie in one group), so the loads are wide and a lane
needs one scale and bias a load. Codes become numbers by bit pattern: `MAGIC | q` is OFF + q in
bf16 (128 + q) or fp16 (1024 + q), exactly; one paired fma takes OFF away and one applies the
scale and bias. 8-bit codes in bf16 (256 values do not fit one exponent) are converted in float32.

A lane may hand the mma its weights in any order along k if the inputs come in the same order:
4-bit pairs are codes (j, j + 4) of a word (what one mask extracts), so the inputs are paired
(x[j], x[j + 4]) too, with one byte permute per pair. On the H100, per call over 32 rows of a
Qwen2-VL-2B layer (4-bit, group 64, 28 layers' weights in turn): 5.6-16 µs where a kernel that
read 4 bytes a lane and scaled each 32-input chunk's dot product after the mma took 9.7-36 µs,
and the dense bf16 kernel 6.8-28 µs (`benchmarks/few_row_cuda.py`).
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_matmul as dense

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

_QUANTIZED_LOOP = """    constexpr int RW = K * BITS / 32;                // 32-bit words per weight row
    constexpr int GPR = K / GS;                      // groups per weight row
    constexpr int XPW = 32 / BITS;                   // inputs per word: 8 (4-bit) or 4 (8-bit)
    constexpr int CPL = VEC * XPW;                   // codes per lane and row in a wide chunk
    constexpr int WIDE = 4 * CPL;                    // a wide chunk: a row group's 4 lanes side by side
    constexpr int KW = K / WIDE;
    const uint32_t* wq = reinterpret_cast<const uint32_t*>(w);
    // W is read once: past L1 (which keeps X, read by every block).
    static_assert(VEC == 2, "a lane loads 8 bytes of a row (few_row_quantized.VEC)");
    auto stream = [](const uint32_t* p, uint32_t (&v)[VEC]) {
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v[0]), "=r"(v[1]) : "l"(p));
    };
    auto bits_of = [](T v) -> uint32_t { return *reinterpret_cast<const unsigned short*>(&v); };
    auto fma2 = [](uint32_t a, uint32_t b, uint32_t c) {
        uint32_t d;
        asm("fma.rn.{mma}x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    };
    const uint32_t one2 = bits_of(static_cast<T>(1.f)) * 0x10001u;
    const uint32_t minus_off2 = bits_of(static_cast<T>(-(float)OFF)) * 0x10001u;
    // One word's codes as weights, in pairs: (scale * q + bias), rounded once to T. 4-bit pairs
    // are codes (j, j + 4) (the inputs are paired the same way); 8-bit pairs are (2j, 2j + 1).
    auto dequant = [&](uint32_t v, uint32_t s2, uint32_t b2, float s, float b, uint32_t (&p)[XPW / 2]) {
        #pragma unroll
        for (int j = 0; j < XPW / 2; ++j) {
            if constexpr (BITS == 4) {
                uint32_t raw;                        // OFF + q per half, exactly: (v >> 4j) & 0xf000f | MAGIC
                asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(raw) : "r"(v >> (4 * j)), "r"(0x000F000Fu), "r"((uint32_t)MAGIC));
                p[j] = fma2(fma2(raw, one2, minus_off2), s2, b2);
            } else if constexpr (MAGIC != 0) {
                const uint32_t raw = __byte_perm(v, (uint32_t)MAGIC, j == 0 ? 0x7170 : 0x7372);
                p[j] = fma2(fma2(raw, one2, minus_off2), s2, b2);
            } else {
                const float lo = (float)((v >> (16 * j)) & 0xff) * s + b;
                const float hi = (float)((v >> (16 * j + 8)) & 0xff) * s + b;
                asm("cvt.rn.{mma}x2.f32 %0, %1, %2;" : "=r"(p[j]) : "f"(hi), "f"(lo));
            }
        }
    };
    for (int kw0 = warp; kw0 < KW; kw0 += U * WARPS) {
        uint32_t a[U][F][2][VEC];
        uint32_t s2[U][F][2], b2[U][F][2];
        float sf[U][F][2], bf[U][F][2];
        #pragma unroll
        for (int u = 0; u < U; ++u) {                // issue every load of U chunks first, unbranched:
            const bool live = kw0 + u * WARPS < KW;  // out-of-range chunks read a valid address and
            const int kw = live ? kw0 + u * WARPS : kw0;  // weigh nothing (scale and bias 0)
            const int group = (kw * WIDE + c * CPL) / GS;
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const size_t n = n0 + f * 16 + h * 8 + g;
                    stream(wq + n * RW + kw * 4 * VEC + c * VEC, a[u][f][h]);
                    const T s = live ? scales[n * GPR + group] : static_cast<T>(0.f);
                    const T b = live ? biases[n * GPR + group] : static_cast<T>(0.f);
                    s2[u][f][h] = bits_of(s) * 0x10001u;
                    b2[u][f][h] = bits_of(b) * 0x10001u;
                    sf[u][f][h] = static_cast<float>(s);
                    bf[u][f][h] = static_cast<float>(b);
                }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool live = kw0 + u * WARPS < KW;
            const int kw = live ? kw0 + u * WARPS : kw0;
            #pragma unroll
            for (int q = 0; q < VEC; ++q) {
                uint32_t xp[MT][XPW / 2];            // this word's inputs of each row tile, paired as the codes
                #pragma unroll
                for (int t = 0; t < MT; ++t) {
                    const int row = t * 8 + g;
                    const T* xr = x + (size_t)(row < M ? row : M - 1) * K + kw * WIDE + c * CPL + q * XPW;
                    const bool used = live && row < M;
                    if constexpr (XPW == 8) {
                        const uint4 r = __ldg(reinterpret_cast<const uint4*>(xr));
                        xp[t][0] = used ? __byte_perm(r.x, r.z, 0x5410) : 0u;
                        xp[t][1] = used ? __byte_perm(r.x, r.z, 0x7632) : 0u;
                        xp[t][2] = used ? __byte_perm(r.y, r.w, 0x5410) : 0u;
                        xp[t][3] = used ? __byte_perm(r.y, r.w, 0x7632) : 0u;
                    } else {
                        const uint2 r = __ldg(reinterpret_cast<const uint2*>(xr));
                        xp[t][0] = used ? r.x : 0u;
                        xp[t][1] = used ? r.y : 0u;
                    }
                }
                #pragma unroll
                for (int f = 0; f < F; ++f) {
                    uint32_t p0[XPW / 2], p1[XPW / 2];  // rows g and g+8 of this feature tile
                    dequant(a[u][f][0][q], s2[u][f][0], b2[u][f][0], sf[u][f][0], bf[u][f][0], p0);
                    dequant(a[u][f][1][q], s2[u][f][1], b2[u][f][1], sf[u][f][1], bf[u][f][1], p1);
                    #pragma unroll
                    for (int t = 0; t < MT; ++t)
                        #pragma unroll
                        for (int st = 0; st < XPW / 4; ++st) {
                            float* d = acc[f][t];
                            asm volatile(
                                "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                                : "r"(p0[2 * st]), "r"(p1[2 * st]), "r"(p0[2 * st + 1]), "r"(p1[2 * st + 1]),
                                  "r"(xp[t][2 * st]), "r"(xp[t][2 * st + 1]));
                        }
                }
            }
        }
    }
"""

# (MAGIC, OFF) per (activation dtype, bits): see the module's docstring. 0: converted in float32.
_CODES = {
    (mx.bfloat16, 4): (0x43004300, 128),
    (mx.float16, 4): (0x64006400, 1024),
    (mx.float16, 8): (0x64006400, 1024),
    (mx.bfloat16, 8): (0, 0),
}

VEC = 2  # 32-bit words a lane loads per weight row and step: 8 bytes (4 and 16 bytes timed slower)


def _wide(bits: int) -> int:
    """Inputs one step of the main loop covers: the 4 lanes of a row group, VEC words each."""
    return 4 * VEC * 32 // bits


_WHAT = "quantized few-row kernel"  # in the log

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
    if n % 16 or k % group or k % _wide(bits) or dtype not in dense.MMA_TYPES or scales.dtype != dtype:
        return False
    if scales.shape != (n, k // group) or layer["biases"].dtype != dtype:
        return False
    return dense.bias_served(layer.get("bias", None), n, dtype)


def _setting(layer: nn.Module, dtype: mx.Dtype, rows: int) -> tuple:
    tiles = dense.row_tiles(rows)
    return (*layer["weight"].shape, layer.bits, layer.group_size, dtype, layer["scales"].dtype, "bias" in layer, tiles)


def serves_layer(layer: nn.Module, x: mx.array) -> bool:
    """An affine-quantized nn.QuantizedLinear / QuantizedEmbedding the kernel takes for input x:
    one whose setting `verify` checked on this device."""
    return verdict(layer, x) is True


def verdict(layer: nn.Module, x: mx.array) -> bool | None:
    """Whether the kernel serves layer(x); None while the layer's setting is not checked yet (the
    answer may then change, once `check` has run)."""
    if not dense.enabled() or not _fits(layer, x.dtype) or not dense.rows_served(x, *_dims(layer)):
        return False
    return _CHECKED.get(_setting(layer, x.dtype, math.prod(x.shape[:-1])))


def verify(module: nn.Module) -> tuple[int, int]:
    """Check the kernel once per quantized layer setting under `module`, at each tile count,
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
    return dense.unchecked(_candidates(module), _setting, _CHECKED)


def check(layer: nn.Module, dtype: mx.Dtype, rows: int) -> bool:
    """Build and check this layer's setting at `rows` (once); until then MLX's matmul serves it."""
    return dense.settle(_CHECKED, _setting(layer, dtype, rows), lambda: _agrees(layer, dtype, rows), _WHAT)


def _candidates(module: nn.Module):
    """(layer, activation dtype, rows) for every quantized layer under `module` the kernel fits,
    at each tile count its launches take."""
    if not dense.enabled():
        return
    for layer in dense.decode_layers(module):
        if not isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        dtype = layer["scales"].dtype
        if _fits(layer, dtype):
            for rows in (dense.MIN_ROWS, dense.MAX_ROWS, dense.NARROW_MAX_ROWS):
                if rows <= dense.most_rows(_dims(layer)[0]):
                    yield layer, dtype, rows


def _check_inputs(layer: nn.Module, dtype: mx.Dtype, rows: int):
    """(x, the layer cut to its first eight blocks' features, launch shape) of the check at `rows`."""
    n, k = _dims(layer)
    x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(dtype)
    shape = launch_shape(x, n, k)
    part = copy.copy(layer)
    part.update({name: v[: min(n, 16 * shape[1] * 8)] for name, v in layer.items() if isinstance(v, mx.array)})
    return x, part, shape


def prefetch(items) -> None:
    """Queue the builds the checks of `items` ((layer, dtype, rows), from `pending`) will take,
    so that they compile in side processes before the checks run (kernel_disk_cache), after what
    the first requests run (the checks come after warm-up's generations)."""
    for layer, dtype, rows in items:
        x, part, shape = _check_inputs(layer, dtype, rows)
        prepare(part, x, shape).note(x, later=True)


def _agrees(layer: nn.Module, dtype: mx.Dtype, rows: int) -> bool:
    """The kernel build this layer takes at `rows`, run on its first output features (up to eight
    blocks' worth: N is a launch size, not part of the build), against the float32 reference."""
    x, part, shape = _check_inputs(layer, dtype, rows)
    w = mx.dequantize(part["weight"], part["scales"], part["biases"], layer.group_size, layer.bits)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    if "bias" in part:
        ref = ref + part["bias"].astype(mx.float32)
    return dense.agrees_with(lambda: matmul(part, x, shape), ref, _WHAT)


def matmul(layer: nn.Module, x: mx.array, shape=None) -> mx.array:
    """x (..., K) @ dequantized(layer.weight).T (+ layer.bias) for a layer `serves_layer` accepts."""
    return prepare(layer, x, shape)(x)


def prepare(layer: nn.Module, x: mx.array, shape=None) -> dense.Launch:
    """`matmul`'s launch for inputs of x's dtype and shape."""
    n, k = _dims(layer)
    bias = layer.get("bias", None)
    names = ("x", "w", "scales", "biases")
    kernel = dense.build("vlmserve_few_row_qmm", _QUANTIZED_LOOP, dense.MMA_TYPES[x.dtype], names, bias is not None)
    magic, off = _CODES[(x.dtype, layer.bits)]
    inputs = [layer["weight"], layer["scales"], layer["biases"]] + ([bias] if bias is not None else [])
    template = [("BITS", layer.bits), ("GS", layer.group_size), ("MAGIC", magic), ("OFF", off), ("VEC", VEC)]
    return dense.Launch(kernel, x, inputs, n, k, template, shape or launch_shape(x, n, k))


def launch_shape(x: mx.array, n: int, k: int) -> tuple[int, int, int, int]:
    """(MT, F, WARPS, U) as in few_row_matmul.launch_shape, chosen by the kernel's time per call
    on the H100 (benchmarks/few_row_cuda.py) for a 2B model's layers at 8 and 32 rows (and kept
    at 64, where it ran one narrow layer's rows faster than two launches of 32): four
    feature tiles per warp for wide layers (X is read by fewer blocks), one for the others, with
    16 warps splitting K (their loads in flight at once). 16 warps take one tile and one step
    in flight: more asks too many registers for a 512-thread block."""
    mt = dense.row_tiles(math.prod(x.shape[:-1]))
    if n >= 8192:
        return mt, next(f for f in (4, 2, 1) if n % (16 * f) == 0), 4, 1
    return mt, 1, 16, 1
