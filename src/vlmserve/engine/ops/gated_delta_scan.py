"""The gated delta rule (the linear attention of Qwen3.5's and Qwen3-Next's hybrid layers) over
a prompt or a decode step as one CUDA kernel.

Where MLX has no Metal kernel, mlx_vlm runs the rule's multi-token calls as a chunked scan
(a 64-step triangular solve and a scan over 64-token chunks: hundreds of launches a layer, and
copies that grow with the square of the chunk) or as a loop of ops per token. On an H200 one
chunked call over 32 rows of 512 positions (16 heads of 128 x 128) took 16.6 ms and over 2
positions 7.4 ms; this kernel takes 5.6 and 0.05 ms, and a Qwen3.5-shaped 2B-class model's
mixed workload went from 261 to 1,049 tok/s at c=32 (docs/benchmarks.md). This kernel walks the prompt in order, as mlx_vlm's Metal kernel does: one warp per
(row, value head, value row) holds that row of the state in float32, Dk / 32 entries a lane,
and each position costs two warp sums. Lengths are shapes the kernel reads, not template
arguments: one build serves every prompt (per model: head counts, head dims, dtypes).

The state and every product are float32, as in mlx_vlm's per-token ops (`gated_delta_ops`);
the output is rounded once to the queries' dtype. Padded positions (mask False) neither decay
nor update the state, as in mlx_vlm's chunked scan; what the output holds there is never read.

A decode step (one position a row) takes it too. There mlx_vlm repeats q and k to the value
heads, slices the position out and runs its step ops, which read the float32 state of every
row four times and write it twice (reductions end the compiler's fusion); the kernel reads and
writes it once, and the compiled decode step of the two-layer test model (one gated delta
layer) went from 221 primitives to 179.

`install(model)` routes the calls of the modules that hold `model`'s gated delta rule here
(calls that ask for the intermediate states keep mlx_vlm's implementation).
"""

from __future__ import annotations

import functools
import sys

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import cuda_kernels
from vlmserve.engine.ops.rebind import rebind_in_mlx_vlm

# mlx_vlm's implementations of the rule over (B, T, ...) inputs, by the name each module gives
# them; each takes (q, k, v, g, beta, state, mask, ...) and returns (y, state, ...).
_ROUTED = ("gated_delta_chunked", "gated_delta_ops")
_WARPS = 4  # value rows a block
_ROUTES: dict = {}  # (name, an mlx_vlm implementation) -> its route (one each: install is idempotent)

_SOURCE = """
    constexpr int NPL = DK / 32;  // state entries a lane holds
    const int lane = threadIdx.x & 31;
    const int dv = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (dv >= DV) return;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (HV / HK);
    const int L = q_shape[1];
    const size_t row = (((size_t)b * HV + h) * DV + dv) * DK + lane * NPL;
    float s[NPL];
    #pragma unroll
    for (int i = 0; i < NPL; ++i) s[i] = static_cast<float>(state[row + i]);
    for (int t = 0; t < L; ++t) {
        const size_t bt = (size_t)b * L + t;
        const size_t qk = (bt * HK + hk) * DK + lane * NPL;
        const size_t hv = bt * HV + h;
        float kk[NPL], qq[NPL];
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            kk[i] = static_cast<float>(k[qk + i]);
            qq[i] = static_cast<float>(q[qk + i]);
        }
        const float decay = GVEC ? 0.0f : static_cast<float>(g[hv]);
        float kv = 0.0f;
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            s[i] *= GVEC ? static_cast<float>(g[hv * DK + lane * NPL + i]) : decay;
            kv += s[i] * kk[i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
        const float delta = (static_cast<float>(v[hv * DV + dv]) - kv) * static_cast<float>(beta[hv]);
        float out = 0.0f;
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            s[i] += kk[i] * delta;
            out += s[i] * qq[i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffffu, out, o);
        if (lane == 0) y[hv * DV + dv] = static_cast<YT>(out);
    }
    #pragma unroll
    for (int i = 0; i < NPL; ++i) state_out[row + i] = s[i];
"""

_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def serves(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state=None, mask=None) -> bool:
    """Whether the kernel runs this call here: CUDA, head dims of 32 to 256 in steps of 32,
    whole key-head groups, one gate a head or one a key, a state and mask of the call's own
    rows (mlx_vlm's ops would broadcast others)."""
    if not cuda_kernels.enabled() or q.ndim != 4 or v.ndim != 4:
        return False
    batch, length, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    return (
        length > 0
        and k.shape == q.shape
        and v.shape[:2] == (batch, length)
        and k_dim % 32 == 0
        and k_dim <= 256
        and v_heads % k_heads == 0
        and g.shape in ((batch, length, v_heads), (batch, length, v_heads, k_dim))
        and beta.shape == (batch, length, v_heads)
        and (state is None or state.shape == (batch, v_heads, v_dim, k_dim))
        and (mask is None or mask.shape == (batch, length))
        and q.dtype == k.dtype == v.dtype  # the output's dtype is theirs, as mlx_vlm's
        and all(t.dtype in _DTYPES for t in (q, g, beta))
        and (state is None or state.dtype in _DTYPES)
    )


def _kernel():  # cuda_kernels.kernel keeps one build per source
    return cuda_kernels.kernel(
        "vlmserve_gated_delta_scan", ("q", "k", "v", "g", "beta", "state"), _SOURCE, ("y", "state_out")
    )


def _template(q: mx.array, v: mx.array, g: mx.array) -> list:
    return [
        ("YT", q.dtype),
        ("HK", q.shape[2]),
        ("HV", v.shape[2]),
        ("DK", q.shape[3]),
        ("DV", v.shape[3]),
        ("GVEC", int(g.ndim == 4)),
    ]


def scan(q, k, v, g, beta, state=None, mask=None) -> tuple[mx.array, mx.array]:
    """The rule over q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g (B, T, Hv) or (B, T, Hv, Dk),
    beta (B, T, Hv), from state (B, Hv, Dv, Dk) (zeros if None), with mask (B, T) False at
    padding. Returns y (B, T, Hv, Dv) in q's dtype and the final state in float32."""
    if state is None:
        state = mx.zeros((q.shape[0], *v.shape[2:], q.shape[3]), dtype=mx.float32)
    if mask is not None:  # padding: no decay, no update
        m = mask.reshape(*mask.shape, *([1] * (g.ndim - 2)))
        g = mx.where(m, g, 1.0)
        beta = mx.where(mask[..., None], beta, 0.0)
    return _launch(q, k, v, g, beta, state)


def _launch(q, k, v, g, beta, state) -> tuple[mx.array, mx.array]:
    """The kernel over every position of every row (no padding)."""
    batch, _, _, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    y, final = _kernel()(
        inputs=[q, k, v, g, beta, state],
        template=_template(q, v, g),
        grid=(v_dim * 32, v_heads, batch),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[v.shape, (batch, v_heads, v_dim, k_dim)],
        output_dtypes=[q.dtype, mx.float32],
    )
    return y, final


def _routed(original):
    """`original` (an mlx_vlm multi-token implementation of the rule) with the calls the kernel
    serves sent to it; calls with more arguments (the intermediate states) stay with `original`."""

    @functools.wraps(original)
    def route(q, k, v, g, beta, state=None, mask=None, *args, **kwargs):
        extra = any(a is not None for a in args) or any(a is not None for a in kwargs.values())
        if extra or kwargs.keys() - {"state_steps", "C"} or not serves(q, k, v, g, beta, state, mask):
            return original(q, k, v, g, beta, state, mask, *args, **kwargs)
        return scan(q, k, v, g, beta, state, mask)

    route.vlmserve_routed = original
    return route


def _rule_modules(model: nn.Module) -> set:
    """The Python modules that implement the gated delta rule `model`'s layers call: those that
    define the `gated_delta_update` the layers' own modules import."""
    found = set()
    for _, layer in model.named_modules():
        update = getattr(sys.modules.get(type(layer).__module__), "gated_delta_update", None)
        home = sys.modules.get(getattr(update, "__module__", None) or "")
        if callable(update) and home is not None:
            found.add(home)
    return found


def install(model: nn.Module, force: bool = False) -> int:
    """Route the gated delta calls of `model`'s layers through the kernel where it
    runs (CUDA; elsewhere mlx_vlm's Metal kernel or its ops serve, unchanged); returns the module
    bindings changed. Idempotent; a route still falls back call by call."""
    if not (force or cuda_kernels.enabled()):
        return 0
    changed = 0
    for module in _rule_modules(model):
        for name in _ROUTED:
            fn = getattr(module, name, None)
            if callable(fn) and not hasattr(fn, "vlmserve_routed"):
                changed += rebind_in_mlx_vlm(name, fn, _ROUTES.setdefault((name, fn), _routed(fn)))
    return changed


def uninstall() -> None:
    """Give mlx_vlm its own implementations back."""
    for (name, original), route in _ROUTES.items():
        rebind_in_mlx_vlm(name, route, original)
