"""FP8 / FP4 weight formats of the released DeepSeek checkpoints (V4 and V4.1): dequantisation and re-quantisation.

Formats (as stored in the released checkpoints):

* **E8M0 scale** (``float8_e8m0fnu``, one unsigned exponent byte): value = 2^(byte - 127). Decoded from the
  *bits* (the byte placed in an fp32 exponent field), never by a numeric cast; 0xFF decodes to NaN. Byte 0 decodes
  to what the family's :class:`QuantScheme` says: 0.0 for V4 (as NeMo's V4 adapter reads it), 2^-127 for V4.1 (the
  E8M0 definition, as torch and NeMo's V4.1 adapter read it). ``float32`` scales are accepted as they are.
* **FP8 block**: weight ``float8_e4m3fn [out, in]`` (logical shape), scale ``[ceil(out/R), ceil(in/C)]`` for tiles
  of ``R x C``: ``W[r, c] = q[r, c] * s[r // R, c // C]``. The tile is the family's: 128 x 128 in V4, 32 x 32 in
  V4.1 (``quantization_config.weight_block_size``); V4.1's Engram tables use 1 x 32 (one scale per row and 32
  columns, :data:`ROW_BLOCK`). Ragged edge tiles cover what is left (the weight is never padded).
* **FP4 packed**: weight ``int8 [out, in/2]``, two e2m1 codes per byte along the input axis, **low nibble =
  column 2j, high nibble = column 2j+1** (the byte read as unsigned); scale ``[out, ceil(in/32)]``:
  ``W[r, c] = E2M1[code(r, c)] * s[r, c // 32]``. Codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are
  their negatives (code 8, -0, decodes to 0).

Dequantising into bf16/fp32 is exact (power-of-two scales, short mantissas). Re-quantisation picks per tile /
group the smallest power of two ``2^k >= amax / 448`` (FP8) or ``>= amax / 6`` (FP4) ("ue8m0"), divides,
clamps and rounds to nearest, ties to even; an all-zero tile gets scale 1 (byte 127). A weight already on the
grid (a released tensor, dequantised) re-quantises to the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_BLOCK = 128  # V4's FP8 tile edge
FP4_GROUP = 32
ROW_BLOCK = (1, FP4_GROUP)  # V4.1 Engram tables: one scale per row and 32 columns
E8M0_MIN = 2.0**-127  # the E8M0 definition of byte 0
FP8_MAX = 448.0
FP4_MAX = 6.0

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
_E2M1_PAIRS = torch.stack((E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)), dim=-1)
"""``[256, 2]``: the values of a packed byte's low nibble (its first column) and high nibble."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QuantScheme:
    """How one checkpoint family stores its quantised weights: the dense FP8 tile ``fp8_block`` (rows, columns)
    and what E8M0 byte 0 decodes to (``e8m0_zero``). Engram tables (V4.1) use :data:`ROW_BLOCK`, routed experts
    packed FP4 with one scale per row and 32 columns in both families."""

    name: str
    fp8_block: tuple[int, int]
    e8m0_zero: float


V4_SCHEME = QuantScheme("deepseek_v4", (FP8_BLOCK, FP8_BLOCK), 0.0)
V41_SCHEME = QuantScheme("deepseek_v41", (32, 32), E8M0_MIN)


# ---------------------------------------------------------------------------------------------- E8M0 scales
def decode_e8m0(scale: torch.Tensor, zero: float = 0.0) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or ``uint8``) -> fp32 ``2^(b-127)`` by bit placement (byte 0 -> ``zero``,
    0xFF -> NaN); fp32 passes through."""
    if scale.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return scale.float()
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"decode_e8m0: expected float8_e8m0fnu, uint8 or a float scale, got {scale.dtype}")
    b = scale.contiguous().view(torch.uint8).to(torch.int32)
    out = (b << 23).view(torch.float32).clone()
    out[b == 255] = float("nan")
    if zero != 0.0:
        out[b == 0] = zero
    return out


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents ``k`` (clamped to [-127, 127]) -> ``float8_e8m0fnu`` bytes ``k + 127``."""
    return (exponent.to(torch.int32).clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_exponent_at_least(x: torch.Tensor) -> torch.Tensor:
    """Smallest integer ``k`` with ``2^k >= x`` (exact, via frexp); 0 where ``x == 0``."""
    mantissa, exp = torch.frexp(x.float())  # x = m * 2^e, m in [0.5, 1)
    k = torch.where(mantissa == 0.5, exp - 1, exp)
    return torch.where(x > 0, k, torch.zeros_like(k))


# ---------------------------------------------------------------------------------------------- FP8 block
Block = tuple[int, int]
_V4_BLOCK: Block = (FP8_BLOCK, FP8_BLOCK)


def fp8_scale_shape(shape: tuple[int, ...] | torch.Size, block: Block = _V4_BLOCK) -> tuple[int, int]:
    """The scale shape of an ``[out, in]`` FP8 weight in tiles of ``block`` (rows, columns)."""
    out, inp = shape
    return _ceil_div(out, block[0]), _ceil_div(inp, block[1])


def _expand(s: torch.Tensor, block: Block, out: int, inp: int) -> torch.Tensor:
    """A per-tile scale -> one value per weight element."""
    return s.repeat_interleave(block[0], dim=0)[:out].repeat_interleave(block[1], dim=1)[:, :inp]


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         block: Block = _V4_BLOCK, zero: float = 0.0) -> torch.Tensor:
    """``float8_e4m3fn [out, in]`` and a ``[ceil(out/R), ceil(in/C)]`` scale (tiles ``block`` = (R, C)) ->
    ``dtype [out, in]``; scale byte 0 decodes to ``zero``."""
    if weight.dim() != 2:
        raise ValueError(f"dequantize_fp8_block: weight must be 2-D, got shape {tuple(weight.shape)}")
    if tuple(scale.shape) != fp8_scale_shape(weight.shape, block):
        raise ValueError(
            f"dequantize_fp8_block: scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"(expected {fp8_scale_shape(weight.shape, block)} for {block[0]}x{block[1]} tiles)"
        )
    out, inp = weight.shape
    return (weight.float() * _expand(decode_e8m0(scale, zero), block, out, inp)).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: Block = _V4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float -> (``float8_e4m3fn [out, in]``, ``float8_e8m0fnu [ceil(out/R), ceil(in/C)]``) in tiles
    of ``block`` = (R, C)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_block: weight must be 2-D, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    out, inp = w.shape
    ro, ri = fp8_scale_shape(w.shape, block)
    padded = w.new_zeros(ro * block[0], ri * block[1])
    padded[:out, :inp] = w
    amax = padded.abs().reshape(ro, block[0], ri, block[1]).amax(dim=(1, 3))
    k = _pow2_exponent_at_least(amax / FP8_MAX).clamp(-127, 127)
    s = torch.ldexp(torch.ones_like(amax), k)
    q = (w / _expand(s, block, out, inp)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, encode_e8m0(k)


# ---------------------------------------------------------------------------------------------- FP4 packed
def fp4_scale_shape(logical_shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    out, inp = logical_shape
    return out, _ceil_div(inp, FP4_GROUP)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """``int8/uint8 [out, n]`` -> ``uint8 codes [out, 2n]``: low nibble -> column 2j, high nibble -> 2j+1."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"unpack_fp4_codes: packed FP4 must be int8 or uint8, got {packed.dtype}")
    u = packed.contiguous().view(torch.uint8)
    lo = u & 0x0F
    hi = u >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*u.shape[:-1], u.shape[-1] * 2)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """``uint8 codes [out, 2n]`` (values 0..15) -> ``int8 [out, n]``, column 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4_codes: the last dimension must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def dequantize_fp4_packed(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          zero: float = 0.0) -> torch.Tensor:
    """``int8 [out, in/2]`` and a ``[out, ceil(in/32)]`` scale -> ``dtype [out, in]``; scale byte 0 decodes to
    ``zero``."""
    if packed.dim() != 2:
        raise ValueError(f"dequantize_fp4_packed: weight must be 2-D, got shape {tuple(packed.shape)}")
    out, half = packed.shape
    inp = 2 * half
    if tuple(scale.shape) != fp4_scale_shape((out, inp)):
        raise ValueError(
            f"dequantize_fp4_packed: scale shape {tuple(scale.shape)} does not match packed weight "
            f"{tuple(packed.shape)} (logical [{out}, {inp}], expected {fp4_scale_shape((out, inp))}: one scale "
            f"per {FP4_GROUP} columns)"
        )
    pairs = _E2M1_PAIRS[packed.contiguous().view(torch.uint8).long()]  # [out, in/2, 2]: both nibbles of a byte
    groups = scale.shape[1]
    if inp == groups * FP4_GROUP:
        return (pairs.view(out, groups, FP4_GROUP) * decode_e8m0(scale, zero).unsqueeze(-1)).view(out, inp).to(dtype)
    s = decode_e8m0(scale, zero).repeat_interleave(FP4_GROUP, dim=1)[:, :inp]
    return (pairs.view(out, inp) * s).to(dtype)


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already clamped to [-6, 6]) -> e2m1 codes, nearest value with ties to the even code.

    The magnitudes are three evenly spaced grids: codes 0-4 are ``0, 0.5, ..., 2`` (step 1/2), codes 4-6 are
    ``2, 3, 4`` (step 1), codes 6-7 are ``4, 6`` (step 2); on each, the code is an even offset plus the magnitude
    rounded on that grid, and ``torch.round`` rounds half to even, so a tie lands on the even code."""
    mag = x.abs()
    idx = torch.where(mag < 2, (mag * 2).round(), torch.where(mag < 4, mag.round() + 2, (mag * 0.5).round() + 4))
    code = idx.to(torch.uint8)
    return torch.where((x < 0) & (code > 0), code + 8, code)


def quantize_fp4_packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float (``in`` even) -> (``int8 [out, in/2]``, ``float8_e8m0fnu [out, ceil(in/32)]``)."""
    if weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"quantize_fp4_packed: weight must be 2-D with an even input dim, got {tuple(weight.shape)}")
    w = weight.detach().float()
    out, inp = w.shape
    groups = _ceil_div(inp, FP4_GROUP)
    if inp != groups * FP4_GROUP:
        padded = w.new_zeros(out, groups * FP4_GROUP)
        padded[:, :inp] = w
    else:
        padded = w
    grouped = padded.view(out, groups, FP4_GROUP)
    k = _pow2_exponent_at_least(grouped.abs().amax(dim=2) / FP4_MAX).clamp(-127, 127)
    s = torch.ldexp(torch.ones(k.shape, device=k.device), k).unsqueeze(-1)  # [out, groups, 1]: one power of two per group
    codes = _round_to_e2m1_codes((grouped / s).clamp(-FP4_MAX, FP4_MAX)).view(out, groups * FP4_GROUP)[:, :inp]
    return pack_fp4_codes(codes), encode_e8m0(k)


QUANT_FORMATS = ("fp8", "fp8_rows", "fp4")


def scale_shape(fmt: str, logical: tuple[int, ...] | torch.Size, scheme: QuantScheme = V4_SCHEME) -> tuple[int, int]:
    """The scale shape of a ``logical [out, in]`` weight stored in ``fmt`` (``"fp8"``: the scheme's tile,
    ``"fp8_rows"``: :data:`ROW_BLOCK`, ``"fp4"``: one per row and 32 columns)."""
    if fmt == "fp8":
        return fp8_scale_shape(logical, scheme.fp8_block)
    if fmt == "fp8_rows":
        return fp8_scale_shape(logical, ROW_BLOCK)
    if fmt == "fp4":
        return fp4_scale_shape(logical)
    raise ValueError(f"scale_shape: unknown format {fmt!r}; expected one of {QUANT_FORMATS}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16,
               scheme: QuantScheme = V4_SCHEME) -> torch.Tensor:
    """One 2-D tensor in release format ``fmt`` (:data:`QUANT_FORMATS`) of family ``scheme`` -> ``dtype [out, in]``."""
    if fmt == "fp8":
        return dequantize_fp8_block(weight, scale, dtype, scheme.fp8_block, scheme.e8m0_zero)
    if fmt == "fp8_rows":
        return dequantize_fp8_block(weight, scale, dtype, ROW_BLOCK, scheme.e8m0_zero)
    if fmt == "fp4":
        return dequantize_fp4_packed(weight, scale, dtype, scheme.e8m0_zero)
    raise ValueError(f"dequantize: unknown format {fmt!r}; expected one of {QUANT_FORMATS}")


def quantize(weight: torch.Tensor, fmt: str, scheme: QuantScheme = V4_SCHEME) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[out, in]`` weight -> its ``(weight, scale)`` in release format ``fmt`` of family ``scheme``."""
    if fmt == "fp8":
        return quantize_fp8_block(weight, scheme.fp8_block)
    if fmt == "fp8_rows":
        return quantize_fp8_block(weight, ROW_BLOCK)
    if fmt == "fp4":
        return quantize_fp4_packed(weight)
    raise ValueError(f"quantize: unknown format {fmt!r}; expected one of {QUANT_FORMATS}")


# ---------------------------------------------------------------------------------------------- kept in the model
# A model may hold release-format tensors as they are (a LoRA base, ``dsv4.peft``): by dtype, ``float8_e4m3fn`` is
# FP8 block and ``int8`` packed FP4; stacked experts carry a leading expert axis. The FP8 tiles and the decoding of
# E8M0 byte 0 are the checkpoint family's (``scheme``: V4's 128 x 128, V4.1's 32 x 32), so the kept bytes and scales
# are the release's as they are.
KEPT_DTYPES = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8}
_KEPT_FORMATS = {dtype: fmt for fmt, dtype in KEPT_DTYPES.items()}


def kept_format(weight: torch.Tensor) -> str | None:
    """``"fp8"`` / ``"fp4"`` for a kept weight by its dtype, None for an ordinary one."""
    return _KEPT_FORMATS.get(weight.dtype)


def quantize_kept(weight: torch.Tensor, fmt: str, scheme: QuantScheme = V4_SCHEME) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight ``[..., out, in]`` -> its kept ``(weight, scale)`` in ``fmt`` of family ``scheme`` (FP8 in the
    scheme's tiles; leading axes kept). On the meta device (the memory plan) only the shapes and dtypes are
    produced."""
    lead, (out, inp) = weight.shape[:-2], weight.shape[-2:]
    if weight.device.type == "meta":
        q_shape = (out, inp) if fmt == "fp8" else (out, inp // 2)
        return (torch.empty(*lead, *q_shape, dtype=KEPT_DTYPES[fmt], device="meta"),
                torch.empty(*lead, *scale_shape(fmt, (out, inp), scheme), dtype=torch.float8_e8m0fnu, device="meta"))
    if fmt not in KEPT_DTYPES:
        raise ValueError(f"quantize_kept: unknown kept format {fmt!r}; expected one of {list(KEPT_DTYPES)}")
    flat = weight.detach().reshape(-1, out, inp)
    pairs = [quantize(w, fmt, scheme) for w in flat]
    q = torch.stack([p[0] for p in pairs]).reshape(*lead, *pairs[0][0].shape)
    s = torch.stack([p[1] for p in pairs]).reshape(*lead, *pairs[0][1].shape)
    return q, s


def dequantize_kept(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    scheme: QuantScheme = V4_SCHEME) -> torch.Tensor:
    """Kept ``(weight, scale)`` of family ``scheme`` -> the logical ``dtype [..., out, in]`` weight (exact:
    power-of-two scales; the values :func:`dequantize` gives the same bytes). A scale whose shape is not the
    scheme's for the weight is a ``ValueError``."""
    fmt = kept_format(weight)
    if weight.device.type == "meta":  # the memory plan: the dequantised weight's shape and dtype
        return torch.empty(logical_shape(weight), dtype=dtype, device="meta")
    if fmt == "fp4":  # one scale row per weight row: the leading axes fold into the rows
        out = dequantize_fp4_packed(weight.reshape(-1, weight.shape[-1]), scale.reshape(-1, scale.shape[-1]), dtype,
                                    scheme.e8m0_zero)
        return out.view(*weight.shape[:-1], 2 * weight.shape[-1])
    if fmt == "fp8":
        if weight.dim() == 2:
            return dequantize(weight, scale, "fp8", dtype, scheme)
        if weight.shape[:-2] != scale.shape[:-2]:
            raise ValueError(f"dequantize_kept: weight {tuple(weight.shape)} and scale {tuple(scale.shape)} differ in "
                             "their leading axes")
        pairs = zip(weight.flatten(0, -3), scale.flatten(0, -3))
        return torch.stack([dequantize(w, s, "fp8", dtype, scheme) for w, s in pairs]).view(weight.shape)
    raise ValueError(f"dequantize_kept: {weight.dtype} is not a kept format (float8_e4m3fn or int8)")


def logical_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The float shape a kept weight stands for (FP4 packs two columns per byte)."""
    return (*weight.shape[:-1], 2 * weight.shape[-1]) if kept_format(weight) == "fp4" else tuple(weight.shape)
