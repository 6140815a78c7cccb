"""A linear layer over a few rows (a decode step's batch) as one CUDA kernel.

On CUDA a compiled decode step is bound by the host's cost per primitive, and MLX's
matmul is the dearest one to launch: each call builds cuBLASLt descriptors, asks for a
heuristic and is captured into the step's graph, whatever the size: 14-22 µs of host time
against 7 µs for this kernel on the hosts measured.
A step has ~4 matmuls per layer. This kernel computes Y = X @ W^T (+ bias) for 2 to 64 rows (32 for
a wide layer; past 32, once `check` passed the build on the device) with tensor-core
`mma.sync` (bf16 / fp16 in, float32 accumulation): each warp streams 16·F rows of W
straight from memory, 16 bytes per lane, for every WARPS-th chunk of 32 inputs, and the
block's warps then add their partial sums in a fixed order (deterministic).

The lane that loads 8 consecutive weights of a row hands 4 of them to each of two mma
steps; the rows of X are loaded the same way, so both operands see the same permutation
of k inside each chunk and the dot products are unchanged. It agrees with MLX's matmul to
float32 summation order (not bit for bit). Other backends, dtypes and shapes keep MLX's.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import cuda_kernels

log = logging.getLogger(__name__)

# One row: MLX's own gemv is as fast. A launch takes up to MAX_ROWS rows of any layer, and up to
# NARROW_MAX_ROWS of a narrow one (fewer than WIDE outputs) once that build is checked (`check`).
MIN_ROWS, MAX_ROWS = 2, 32
NARROW_MAX_ROWS, WIDE = 64, 8192

MMA_TYPES = {mx.bfloat16: "bf16", mx.float16: "f16"}

# Shared by the dense and the quantized kernel: the launch's rows and width, the lanes' roles and
# the float32 accumulators.
PROLOGUE = """
    // Rows and width from the launch itself, not from an array: MLX keeps arrays of a few bytes in
    // host-shared (managed) memory, and a kernel that reads one waits on it.
    int M = 1;
    for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];
    const int N = gridDim.x * 16 * F;                // one build serves every M and N of this K
    constexpr int KC = K / 32;                       // chunks of 32 inputs
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;           // mma fragment row group, column pair
    const size_t n0 = (size_t)blockIdx.x * 16 * F;   // this block's first output feature
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[F][MT][4];
    #pragma unroll
    for (int f = 0; f < F; ++f)
        #pragma unroll
        for (int t = 0; t < MT; ++t)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[f][t][r] = 0.f;
"""

# The dense main loop: each lane streams 8 bf16/fp16 weights of two rows per chunk.
_DENSE_LOOP = """    const uint4* wv = reinterpret_cast<const uint4*>(w);
    // W is read once: past L1 (which keeps X, read by every block), with the next 256 bytes into L2.
    auto stream = [](const uint4* p) {
        uint4 v;
        asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        return v;
    };
    for (int kc0 = warp; kc0 < KC; kc0 += U * WARPS) {
        uint4 a[U][F][2], b[U][MT];
        #pragma unroll
        for (int u = 0; u < U; ++u) {                // issue every load of U chunks first, unbranched:
            const bool live = kc0 + u * WARPS < KC;  // out-of-range chunks and rows read a valid
            const int kc = live ? kc0 + u * WARPS : kc0;  // address and are zeroed after
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[u][f][h] = stream(wv + ((n0 + f * 16 + h * 8 + g) * K + kc * 32) / 8 + c);
                    if (!live) a[u][f][h] = zero;
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
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int t = 0; t < MT; ++t) {
                    float* d = acc[f][t];
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                        : "r"(a[u][f][0].x), "r"(a[u][f][1].x), "r"(a[u][f][0].y), "r"(a[u][f][1].y),
                          "r"(b[u][t].x), "r"(b[u][t].y));
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                        : "r"(a[u][f][0].z), "r"(a[u][f][1].z), "r"(a[u][f][0].w), "r"(a[u][f][1].w),
                          "r"(b[u][t].z), "r"(b[u][t].w));
                }
    }
"""

# Shared: the warps' partial sums added in a fixed order, (+ bias), stored as T.
EPILOGUE = """    // Sum the warps' partials pairwise, always in the same order.
    __shared__ float red[WARPS > 1 ? WARPS / 2 : 1][F * MT * 4][32];
    #pragma unroll
    for (int half = WARPS / 2; half >= 1; half /= 2) {
        if (warp >= half && warp < 2 * half) {
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int t = 0; t < MT; ++t)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) red[warp - half][(f * MT + t) * 4 + r][lane] = acc[f][t][r];
        }
        __syncthreads();
        if (warp < half) {
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int t = 0; t < MT; ++t)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[f][t][r] += red[warp][(f * MT + t) * 4 + r][lane];
        }
        __syncthreads();
    }
    if (warp != 0) return;
    #pragma unroll
    for (int f = 0; f < F; ++f)
        #pragma unroll
        for (int t = 0; t < MT; ++t)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {             // c0..c3: (feature g | g+8) x (row 2c | 2c+1)
                const size_t n = n0 + f * 16 + (r >> 1) * 8 + g;
                const int m = t * 8 + 2 * c + (r & 1);
                if (m < M) {
                    float v = acc[f][t][r];
                    {bias}
                    y[(size_t)m * N + n] = static_cast<T>(v);
                }
            }
"""


_SWITCHED_ON = os.environ.get("VLMSERVE_FEW_ROW_MATMUL", "1") != "0"  # read once, as cuda_kernels' switch


def enabled() -> bool:
    """CUDA with vlmserve's kernels on, and VLMSERVE_FEW_ROW_MATMUL not 0."""
    return _SWITCHED_ON and cuda_kernels.enabled()


def most_rows(n: int) -> int:
    """The most rows one launch takes for a layer of n outputs. On the H100 a 64-row launch of a
    narrow 2B layer (4-bit) took 7.9 µs against 2 x 5.7 for two launches of 32, and a decode
    step pays the host's time per launch on top (cuBLAS's matmul ~20 µs of it a call); a wide
    layer's took longer than two (gate-up 35 against 2 x 16 µs, the logits 209 against 2 x 80)."""
    return NARROW_MAX_ROWS if n < WIDE else MAX_ROWS


def rows_served(x: mx.array, n: int, k: int) -> bool:
    """An input (..., K) whose rows (all axes but the last) number MIN_ROWS to most_rows(n)."""
    return x.ndim >= 1 and x.shape[-1] == k and MIN_ROWS <= math.prod(x.shape[:-1]) <= most_rows(n)


def bias_served(bias: mx.array | None, n: int, dtype: mx.Dtype) -> bool:
    return bias is None or (bias.shape == (n,) and bias.dtype == dtype)


def _weight_fits(weight: mx.array, bias: mx.array | None) -> bool:
    """On CUDA with the kernels on: a bf16/fp16 weight (N, K) with N % 16 == 0 and K % 32 == 0."""
    if not enabled() or weight.ndim != 2 or weight.dtype not in MMA_TYPES:
        return False
    n, k = weight.shape
    return not (n % 16 or k % 32) and bias_served(bias, n, weight.dtype)


def verdict(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> bool | None:
    """Whether the kernel serves x @ weight.T (+ bias) for an input of the weight's dtype:
    up to MAX_ROWS rows wherever the weight fits; past that, up to most_rows(N) once `check`
    passed the build on this device (None until it has run)."""
    if not _weight_fits(weight, bias) or x.dtype != weight.dtype or not rows_served(x, *weight.shape):
        return False
    rows = math.prod(x.shape[:-1])
    return True if rows <= MAX_ROWS else _CHECKED.get(_setting(weight, bias, rows))


def serves(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> bool:
    return verdict(x, weight, bias) is True


def row_tiles(rows: int) -> int:
    """8-row tiles per launch: few counts (each is a build, ~1-2 s of JIT)."""
    return 1 if rows <= 8 else 4 if rows <= MAX_ROWS else 8


def launch_shape(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(MT, F, WARPS, U) for m <= most_rows(n) rows: 8-row tiles, 16-feature tiles per warp, warps
    splitting K, chunks in flight. Chosen by the kernel's own time on the H100 for each layer
    shape of a 2B-parameter decode step, one call at a time as a step runs them: wide layers
    want several feature tiles per warp (X is read fewer times), deep ones many warps per block,
    narrow ones all their loads in flight at once."""
    mt = row_tiles(m)
    wide, deep = n >= WIDE, k >= 4096
    if wide:
        f = next(f for f in (4, 2, 1) if n % (16 * f) == 0)
        return mt, f, 4, 1
    # Deep layers: 16 warps, not the 32 that timed 20% faster, so a build never asks more than
    # 128 registers a thread (a 1024-thread block gets 64; past that the launch fails). Eight
    # row tiles keep two chunks in flight, not eight: each holds a 16-byte load per tile.
    return (mt, 1, 16, 1) if deep else (mt, 1, 8, 8 if mt <= 4 else 2)


# Builds past MAX_ROWS rows checked on this device: (K, dtype, bias, launch shape) -> passed.
_CHECKED: dict[tuple, bool] = {}


def _setting(weight: mx.array, bias: mx.array | None, rows: int) -> tuple:
    n, k = weight.shape
    return k, weight.dtype, bias is not None, launch_shape(rows, n, k)


def pending(module: nn.Module) -> list[tuple[nn.Linear, int]]:
    """(layer, rows) for each build past MAX_ROWS rows that the dense linear layers under `module`
    would take and that is not checked yet: a build (~1 s of JIT on CUDA) and a check apiece."""
    return unchecked(_candidates(module), _layer_setting, _CHECKED)


def _layer_setting(layer: nn.Linear, rows: int) -> tuple:
    return _setting(layer["weight"], layer.get("bias", None), rows)


def _candidates(module: nn.Module):
    """(layer, rows) for each dense linear layer under `module` the kernel fits whose launches
    take eight row tiles (a narrow one)."""
    if not enabled():
        return
    for layer in decode_layers(module):
        if type(layer) is not nn.Linear or not _weight_fits(layer["weight"], layer.get("bias", None)):
            continue
        if most_rows(layer["weight"].shape[0]) == NARROW_MAX_ROWS:
            yield layer, NARROW_MAX_ROWS


def decode_layers(module: nn.Module):
    """The modules under `module` a decode step may call: all but a fused projection's own parts
    (`_alone`), which serve only inputs a decode step never gives them."""
    for name, layer in module.named_modules():
        if "_alone" not in name.split("."):
            yield layer


def unchecked(candidates, setting_of, checked: dict) -> list[tuple]:
    """The candidates (each the arguments of a check) whose setting is not in `checked` yet, one
    per setting."""
    todo, seen = [], set()
    for item in candidates:
        setting = setting_of(*item)
        if setting not in checked and setting not in seen:
            seen.add(setting)
            todo.append(item)
    return todo


def check(layer: nn.Linear, rows: int) -> bool:
    """Build and check the kernel this layer takes at `rows` (once per build) against a float32
    matmul, on its first output features (N is a launch size, not part of the build); until it
    passes, MLX's matmul serves those rows."""
    weight, bias = layer["weight"], layer.get("bias", None)
    return settle(_CHECKED, _layer_setting(layer, rows), lambda: _agrees(weight, bias, rows), "few-row kernel")


def _check_inputs(weight: mx.array, bias: mx.array | None, rows: int):
    """(x, weight part, bias part, launch shape) of the check at `rows`: eight blocks' features."""
    n, k = weight.shape
    shape = launch_shape(rows, n, k)
    keep = min(n, 16 * shape[1] * 8)
    x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(weight.dtype)
    return x, weight[:keep], None if bias is None else bias[:keep], shape


def _agrees(weight: mx.array, bias: mx.array | None, rows: int) -> bool:
    x, w, b, shape = _check_inputs(weight, bias, rows)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    if b is not None:
        ref = ref + b.astype(mx.float32)
    return agrees_with(lambda: matmul(x, w, b, shape), ref, "few-row kernel")


def prefetch(items) -> None:
    """Queue the builds the checks of `items` ((layer, rows), from `pending`) will take, so that
    they compile in side processes before the checks run (kernel_disk_cache), after what the
    first requests run (the checks come after warm-up's generations)."""
    for layer, rows in items:
        x, w, b, shape = _check_inputs(layer["weight"], layer.get("bias", None), rows)
        prepare(x, w, b, shape).note(x, later=True)


def prefetch_served(module: nn.Module) -> None:
    """Queue the builds a decode step's dense layers under `module` take up to MAX_ROWS rows, at
    each tile count (served without a check, so `pending` does not name them)."""
    if not enabled():
        return
    for layer in decode_layers(module):
        if type(layer) not in (nn.Linear, nn.Embedding):  # an Embedding: tied logits (few_row_linear)
            continue
        weight, bias = layer["weight"], layer.get("bias", None)
        for rows in (MIN_ROWS, MAX_ROWS):
            x = mx.zeros((rows, 1, weight.shape[1]), dtype=weight.dtype)
            if verdict(x, weight, bias):
                prepare(x, weight, bias).note(x)


def settle(checked: dict, setting: tuple, agrees, what: str) -> bool:
    """`checked[setting]`, first set to agrees() (a build and a check, once per setting)."""
    if setting not in checked:
        checked[setting] = agrees()
        if not checked[setting]:
            log.warning("the %s disagrees for %s: MLX's matmul serves it", what, setting)
    return checked[setting]


def agrees_with(run, ref: mx.array, what: str) -> bool:
    """Whether run() (a kernel) is within bf16/fp16 rounding of the float32 reference `ref`; a
    build or launch the device refuses disagrees."""
    try:
        ours = run().astype(mx.float32)
        scale = mx.abs(ref).max()
        return bool(mx.all(mx.abs(ours - ref) <= 1e-2 * scale + 1e-2 * mx.abs(ref)).item())
    except Exception:  # noqa: BLE001 - a build or launch this device refuses: MLX's matmul serves it
        log.warning("the %s failed to run on this device", what, exc_info=True)
        return False


@functools.cache
def build(name: str, loop: str, mma: str, inputs: tuple[str, ...], with_bias: bool):
    """A few-row kernel: PROLOGUE, this main loop, EPILOGUE (adding `bias` if given), for one
    mma input type; each distinct source is built once."""
    source = (PROLOGUE + loop + EPILOGUE).replace("{mma}", mma)
    source = source.replace("{bias}", "v += static_cast<float>(bias[n]);" if with_bias else "")
    inputs = inputs + (("bias",) if with_bias else ())
    return cuda_kernels.kernel(f"{name}_{mma}{'_bias' if with_bias else ''}", inputs, source, output_names=("y",))


class Launch:
    """A few-row kernel's launch for one input dtype and shape, worked out once: call it with the
    input x (..., K) for y (..., N) in x's dtype. A decode step makes ~100 of these calls, and
    on CUDA its time is mostly the host's, so what can be settled once is (few_row_linear)."""

    __slots__ = ("kernel", "inputs", "n", "template", "grid", "threadgroup")

    def __init__(self, kernel, x: mx.array, inputs: list[mx.array], n: int, k: int, template: list, shape=None):
        """`inputs` are the kernel's after x; `shape` overrides launch_shape."""
        mt, f, warps, u = shape or launch_shape(math.prod(x.shape[:-1]), n, k)
        self.kernel, self.inputs, self.n = kernel, inputs, n
        self.template = [("T", x.dtype), ("K", k), ("MT", mt), ("F", f), ("WARPS", warps), ("U", u), *template]
        self.grid = (n // (16 * f) * 32 * warps, 1, 1)
        self.threadgroup = (32 * warps, 1, 1)

    def note(self, x: mx.array, later: bool = False) -> None:
        """Queue this launch's build for the kernel cache ahead of its first use (kernel_disk_cache;
        `later`: after the builds its filing needs sooner)."""
        cuda_kernels.note_build(
            self.kernel, inputs=[x, *self.inputs], output_dtypes=[x.dtype], template=self.template, later=later
        )

    def __call__(self, x: mx.array) -> mx.array:
        return self.kernel(
            inputs=[x, *self.inputs],
            template=self.template,
            grid=self.grid,
            threadgroup=self.threadgroup,
            output_shapes=[x.shape[:-1] + (self.n,)],
            output_dtypes=[x.dtype],
        )[0]


def matmul(x: mx.array, weight: mx.array, bias: mx.array | None = None, shape=None) -> mx.array:
    """x (..., K) @ weight.T (+ bias) for a weight (N, K) and input `serves` accepts."""
    return prepare(x, weight, bias, shape)(x)


def prepare(x: mx.array, weight: mx.array, bias: mx.array | None = None, shape=None) -> Launch:
    """`matmul`'s launch for inputs of x's dtype and shape."""
    n, k = weight.shape
    kernel = build("vlmserve_few_row_mm", _DENSE_LOOP, MMA_TYPES[weight.dtype], ("x", "w"), bias is not None)
    return Launch(kernel, x, [weight] + ([bias] if bias is not None else []), n, k, [], shape)
