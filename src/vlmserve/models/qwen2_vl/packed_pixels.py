"""Qwen-VL patches made on the device from packed uint8 frames (image_processor.py, `packed=True`).

Preprocessing ships each image as its resized uint8 bytes plus a 3x256 table of finished
values (the processor's rescale and normalize, already cast to the tower's dtype). Here the
worker looks every byte up in that table and moves the values into the processor's patch
order, the temporal frames repeated: gathers and copies only, so the patches have exactly the
bits `unpack_patches` (the NumPy twin) and the processor give, from a quarter of the bytes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def expand(raw: mx.array, table: mx.array, grids: np.ndarray, layout) -> mx.array:
    """(sum of H*W*3,) uint8 frames -> (patches, 3 * temporal * patch²) pixel values in table's dtype."""
    ps, tps, ms = (int(v) for v in layout)
    channels = table.shape[0]
    lut = table.reshape(-1)
    offsets = mx.arange(channels, dtype=mx.int32) * table.shape[1]  # channel c reads table row c
    pieces, start = [], 0
    for t, gh, gw in np.asarray(grids).tolist():
        if t != 1:
            raise ValueError(f"packed pixels hold single frames, not a grid of {t} frames")
        n = gh * ps * gw * ps * channels
        frame = raw[start : start + n].reshape(gh * ps, gw * ps, channels)
        start += n
        vals = lut[frame.astype(mx.int32) + offsets]
        # (block row, merge row, patch row, block col, merge col, patch col, channel) ->
        # (block row, block col, merge row, merge col, channel, frame, patch row, patch col)
        vals = vals.reshape(gh // ms, ms, ps, gw // ms, ms, ps, channels).transpose(0, 3, 1, 4, 6, 2, 5)
        vals = mx.broadcast_to(vals[:, :, :, :, :, None], (gh // ms, gw // ms, ms, ms, channels, tps, ps, ps))
        pieces.append(vals.reshape(gh * gw, channels * tps * ps * ps))
    if start != raw.size:
        raise ValueError(f"packed pixels hold {raw.size} bytes; their grids need {start}")
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
