"""Runs one config on one device through the public Python API and returns every output as raw
bytes. The same code runs CUDA tensors (the kernels) and CPU tensors (the reference): only the
device differs, so a CPU run is also a dry run of the CUDA path's calls.

Buffers are read as raw bytes (`.view(torch.uint8)`), so a change of the code / scale buffers'
dtype (uint8 -> torch float8 types) does not affect the comparison; the dtype is recorded too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from . import fp
from .gen import Arr

_INT = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32, "uint8": np.uint8, "int32": np.int32,
        "int64": np.int64}
MX_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


@dataclass
class Out:
    """One output: its bytes (flat uint8, C order), logical shape, dtype name and item size."""
    raw: np.ndarray
    shape: tuple
    dtype: str
    itemsize: int

    def elements(self) -> np.ndarray:
        """Elements as unsigned integers of the item size (flat)."""
        return self.raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[self.itemsize])


class OpError(Exception):
    """The op raised: the message is the output."""


def _torch():
    import torch

    return torch


def torch_dtype(name: str):
    t = _torch()
    return {"bfloat16": t.bfloat16, "float16": t.float16, "float32": t.float32, "uint8": t.uint8, "int32": t.int32,
            "int64": t.int64}[name]


def to_tensor(a: Arr, device: str):
    """(the view as a torch tensor on `device`, its base tensor)."""
    torch = _torch()
    base = torch.from_numpy(np.ascontiguousarray(a.base).view(_INT[a.dtype]).copy())
    if a.dtype in ("bfloat16", "float16", "float32"):
        base = base.view(torch_dtype(a.dtype))
    base = base.to(device)
    return torch.as_strided(base, a.view.shape, a.view.strides, a.view.offset), base


def from_numpy(a: np.ndarray, device: str):
    """uint8 / int32 / int64 numpy data as a contiguous torch tensor on `device`."""
    return _torch().from_numpy(np.ascontiguousarray(a).copy()).to(device)


def out_of(t) -> Out:
    torch = _torch()
    t = t.detach()
    shape = tuple(int(s) for s in t.shape)
    dtype = str(t.dtype).replace("torch.", "")
    c = t.contiguous().cpu().reshape(-1)
    raw = c.view(torch.uint8).numpy().copy() if c.numel() else np.zeros(0, np.uint8)
    return Out(raw, shape, dtype, int(t.element_size()))


def _overwrite(t, a: np.ndarray):
    """Overwrite a buffer's bytes in place (any dtype of one byte per element)."""
    torch = _torch()
    flat = t.view(torch.uint8).reshape(-1)
    src = torch.from_numpy(np.ascontiguousarray(a).reshape(-1).copy()).to(t.device)
    if flat.numel() != src.numel():
        raise OpError(f"buffer of shape {tuple(t.shape)} holds {flat.numel()} bytes, the fuzzer expected {src.numel()}")
    flat.copy_(src)


def _mx_outs(q, prefix: str = "") -> dict:
    out = {}
    for f in MX_FIELDS:
        v = getattr(q, f, None)
        if v is not None:
            out[prefix + f] = out_of(v)
    return out


def poison_allocator(device: str) -> None:
    """Fill memory that the CUDA caching allocator will hand out next with 0xA5, so that an output
    byte a kernel forgets to write (padding!) shows instead of reading as a lucky zero."""
    if not device.startswith("cuda") or os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        return  # (no cache to poison: every tensor is its own cudaMalloc, e.g. under compute-sanitizer)
    torch = _torch()
    for n in (1 << 20, 1 << 19, 1 << 19, 32 << 20):
        torch.empty(n, dtype=torch.uint8, device=device).fill_(0xA5)


_SIDE = {}


def _side_stream(device: str):
    if device not in _SIDE:
        _SIDE[device] = _torch().cuda.Stream(device=device)
    return _SIDE[device]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        _torch().cuda.synchronize()


# ----------------------------------------------------------------------------- per op
def _quantize(cfg, ins, dev, mx):
    x, _ = to_tensor(ins["x"], dev)
    q = mx.quantize(x, rowwise=cfg["rowwise"], columnwise=cfg["columnwise"], fp8_format=cfg["fmt"],
                    swizzle=cfg["swizzle"])
    return _mx_outs(q)


def _quantize_attention(cfg, ins, dev, mx):
    x, _ = to_tensor(ins["x"], dev)
    q = mx.quantize_attention(x, layout=cfg["layout"], rowwise=cfg["rowwise"], columnwise=cfg["columnwise"],
                              fp8_format=cfg["fmt"], bhsd_scales=cfg["bhsd_scales"])
    return _mx_outs(q)


def _dequantize(cfg, ins, dev, mx):
    torch = _torch()
    x, _ = to_tensor(ins["x"], dev)
    if cfg["source"] == "plain":
        q = mx.quantize(x, rowwise=cfg["rowwise"], columnwise=cfg["columnwise"], fp8_format=cfg["fmt"],
                        swizzle=cfg["scale_layout"] == "swizzled")
    else:
        q = mx.quantize_attention(x, layout=cfg["layout"], rowwise=cfg["rowwise"], columnwise=cfg["columnwise"],
                                  fp8_format=cfg["fmt"], bhsd_scales=cfg["scale_layout"] == "bhsd")
    if cfg["bytes"] != "quantized":
        for d, key in (("rowwise", "random_rs"), ("columnwise", "random_cs")):
            if getattr(q, f"{d}_data", None) is None:
                continue
            if cfg["bytes"] == "random":
                _overwrite(getattr(q, f"{d}_data"), ins["random_codes"])
            _overwrite(getattr(q, f"{d}_scale_inv"), ins[key])
    out = _mx_outs(q, "q.")
    od = torch_dtype(cfg["out_dtype"])
    for d in ("rowwise", "columnwise"):
        if getattr(q, f"{d}_data", None) is not None:
            out[f"deq_{d}"] = out_of(mx.dequantize(q, dtype=od, columnwise=d == "columnwise"))
    return out


def _swizzle(cfg, ins, dev, mx):
    s = from_numpy(ins["scales"].logical(), dev)
    M, K, rw = cfg["M"], cfg["K"], cfg["rowwise"]
    fwd, inv = (mx.swizzle_scales, mx.unswizzle_scales) if cfg["op"] == "swizzle_scales" else (mx.unswizzle_scales, mx.swizzle_scales)
    y = fwd(s, M, K, rowwise=rw)
    return {"out": out_of(y), "roundtrip": out_of(inv(y, M, K, rowwise=rw))}


def _attention_scales_to_bhsd(cfg, ins, dev, mx):
    s = from_numpy(ins["scales"].logical(), dev)
    y = mx.attention_scales_to_bhsd(s, list(cfg["shape"]), cfg["layout"], cfg["rowwise"])
    return {"out": out_of(y)}


def _to_bhsd(cfg, ins, dev, mx):
    qs, out = [], {}
    for i, t in enumerate(cfg["tensors"]):
        x, _ = to_tensor(ins[f"x{i}"], dev)
        q = mx.quantize_attention(x, layout=t["layout"], rowwise=t["rowwise"], columnwise=t["columnwise"],
                                  fp8_format=t["fmt"], bhsd_scales=False)
        if t["random_scales"]:
            if q.rowwise_scale_inv is not None:
                _overwrite(q.rowwise_scale_inv, ins[f"rs{i}"])
            if q.columnwise_scale_inv is not None:
                _overwrite(q.columnwise_scale_inv, ins[f"cs{i}"])
        out.update(_mx_outs(q, f"t{i}.p1."))
        qs.append(q)
    res = mx.to_bhsd(*qs)
    if len(res) != len(qs):
        raise OpError(f"to_bhsd returned {len(res)} tensors for {len(qs)}")
    for i, q in enumerate(res):
        out.update(_mx_outs(q, f"t{i}."))
    return out


def _rope_tables_and_kw(cfg, ins, dev):
    cos, _ = to_tensor(ins["cos"], dev)
    sin, _ = to_tensor(ins["sin"], dev)
    cu = None
    if cfg["cu_seqlens"] is not None:
        cu = from_numpy(ins["cu_seqlens"], dev if cfg["cu_seqlens"]["device"] == "same" else "cpu")
    kw = dict(style=cfg["style"], layout=cfg["layout"], rope_dim=cfg["rope_dim"], cu_seqlens=cu,
              tables_per_token=cfg["tables_per_token"])
    return cos, sin, kw


def _rope(cfg, ins, dev, mx):
    x, xbase = to_tensor(ins["x"], dev)
    cos, sin, kw = _rope_tables_and_kw(cfg, ins, dev)
    fn = mx.apply_rope if cfg["op"] == "apply_rope" else mx.rope_backward
    out = {}
    if cfg["out"] == "alloc":
        y = fn(x, cos, sin, **kw)
    elif cfg["out"] == "inplace":
        y = fn(x, cos, sin, out=x, **kw)
        if y is not x and (y.data_ptr() != x.data_ptr() or tuple(y.stride()) != tuple(x.stride())):
            raise OpError("with out=x the op did not return x")
    else:
        o, obase = to_tensor(ins["out"], dev)
        y = fn(x, cos, sin, out=o, **kw)
        if y.data_ptr() != o.data_ptr():
            raise OpError("with out=view the op did not return the view")
        out["out_base"] = out_of(obase)
    out["out"] = out_of(y)
    out["x_base"] = out_of(xbase)  # in place: the whole buffer (outside the view untouched); else: unchanged
    return out


def _rope_backward_quantize(cfg, ins, dev, mx):
    x, xbase = to_tensor(ins["x"], dev)
    cos, sin, kw = _rope_tables_and_kw(cfg, ins, dev)
    r = mx.rope_backward_quantize(x, cos, sin, rowwise=cfg["rowwise"], columnwise=cfg["columnwise"],
                                  fp8_format=cfg["fmt"], swizzle=cfg["swizzle"], dx_copy=cfg["dx_copy"], **kw)
    out = {}
    if cfg["dx_copy"]:
        q, dx = r
        out["dx"] = out_of(dx)
    else:
        q = r
    out.update(_mx_outs(q))
    out["x_base"] = out_of(xbase)
    return out


def _fused(cfg, ins, dev, mx):
    x, _ = to_tensor(ins["x"], dev)
    w, _ = to_tensor(ins["w"], dev)
    cos, _ = to_tensor(ins["cos"], dev)
    sin, _ = to_tensor(ins["sin"], dev)
    r = mx.fused_q_uproj_rope_quant(x, w, cos, sin, nope_dim=cfg["nope"], rope_dim=cfg["rope"], style=cfg["style"],
                                    layout=cfg["layout"], batch=cfg["batch"], weight_layout=cfg["weight_layout"],
                                    rowwise=cfg["rowwise"], columnwise=cfg["columnwise"], fp8_format=cfg["fmt"],
                                    bhsd_scales=cfg["bhsd_scales"], return_q=cfg["return_q"])
    out = {}
    if cfg["return_q"]:
        q, qb = r
        out["q"] = out_of(qb)
    else:
        q = r
    out.update(_mx_outs(q))
    return out


# ----------------------------------------------------------------------------- attention / gemm
def _edit_scales(q8, sedits) -> None:
    """Scale-byte edits (direction, flat index, byte) on a fresh quantization's contiguous buffers."""
    torch = _torch()
    for d, name in ((0, "rowwise_scale_inv"), (1, "columnwise_scale_inv")):
        e = sedits[sedits[:, 0] == d]
        buf = getattr(q8, name, None)
        if not e.size or buf is None:
            continue
        # edits apply in order: of several at one index the last one stays (an index_put with repeated
        # indices leaves an unspecified one on CUDA, so the repeats are dropped first)
        idx = e[:, 1]
        last = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
        e = e[np.sort(last)]
        flat = buf.view(torch.uint8).reshape(-1)
        flat[torch.from_numpy(e[:, 1].copy()).to(flat.device)] = torch.from_numpy(e[:, 2].astype(np.uint8)).to(flat.device)


def _edit_codes(codes, cedits) -> None:
    """Code edits (flat index in the logical order, byte) on a codes tensor of any strides."""
    shape = tuple(codes.shape)
    for flat, byte in cedits:
        codes[np.unravel_index(int(flat), shape)] = int(byte)


def _shared(store: dict, key: str, arr: np.ndarray, dtype: str, dev: str):
    """One device buffer per base array (packed views of one buffer share it)."""
    if key not in store:
        store[key] = to_tensor(Arr(arr, dtype, _flat_view(arr.size)), dev)[1]
    return store[key]


def _flat_view(n: int):
    from .data import View

    return View(n, 0, (n,), (1,))


def _mx_operand(cfg, op, ins, name: str, read_rowwise: bool, dev, mx, store: dict):
    """An MXFP8 operand: quantized on `dev` from its source values, scale edits, the read direction's
    codes copied into their view (op["place"] == "view") or kept, code edits. Returns (the
    MXFP8Tensor the op gets, {output name: base tensor to read back afterwards})."""
    torch = _torch()
    x, _ = to_tensor(ins[f"{name}.src"], dev)
    both = op["dirs"] == "both"
    rw, cw = read_rowwise or both, (not read_rowwise) or both
    fmt = cfg["fp8_format"]
    if op.get("kind") == "attn":
        q8 = mx.quantize_attention(x, layout=op["fmt"], rowwise=rw, columnwise=cw, fp8_format=fmt,
                                   bhsd_scales=op["scale_layout"] == "bhsd")
    else:
        q8 = mx.quantize(x, rowwise=rw, columnwise=cw, fp8_format=fmt, swizzle=op["scale_layout"] == "swizzled")
    _edit_scales(q8, ins[f"{name}.sedits"])
    d = "rowwise" if read_rowwise else "columnwise"
    shape = tuple(op["shape"])  # the codes as the op reads them (the quantized shape's dims merged)
    bases = {}
    if op["place"] == "view":
        from .data import View

        v = View.from_json(op["view"])
        key = f"{'pack' if op.get('packed') else name}.codes_base"
        base = _shared(store, key, ins[f"{name}.codes_base"], "uint8", dev)
        codes = torch.as_strided(base, v.shape, v.strides, v.offset)
        codes.copy_(getattr(q8, f"{d}_data").reshape(shape))
        bases[key] = base
        fields = {f"{d}_data": codes, f"{d}_scale_inv": getattr(q8, f"{d}_scale_inv")}
    else:
        fields = {}
        for dd in ("rowwise", "columnwise"):
            c = getattr(q8, f"{dd}_data")
            if c is not None:
                fields[f"{dd}_data"], fields[f"{dd}_scale_inv"] = c.reshape(shape), getattr(q8, f"{dd}_scale_inv")
        codes = fields[f"{d}_data"]
    _edit_codes(codes, ins[f"{name}.cedits"])
    t = mx.MXFP8Tensor(tuple(q8.shape), q8.fp8_format, q8.scale_layout, fields.get("rowwise_data"),
                       fields.get("rowwise_scale_inv"), fields.get("columnwise_data"), fields.get("columnwise_scale_inv"),
                       layout=q8.layout, attention=q8.attention)
    return t, bases


def _attention_args(cfg, ins, dev, mx) -> tuple:
    """(operands {q, k, v}, {output name: base tensor to read back}, attention's keyword arguments,
    the format argument) of an attention config on `dev`."""
    torch = _torch()
    store, bases, ops = {}, {}, {}
    for role in ("q", "k", "v"):
        op = cfg[role]
        if op["prec"] == "bf16":
            from .data import View

            v = View.from_json(op["view"])
            key = f"{'pack' if op['packed'] else role}.base"
            base = _shared(store, key, ins[f"{role}.x"].base, "bfloat16", dev)
            ops[role] = torch.as_strided(base, v.shape, v.strides, v.offset)
            bases[key] = base
        else:
            ops[role], b = _mx_operand(cfg, op, ins, role, role != "v", dev, mx, store)
            bases.update(b)
    qf, kvf = cfg["q_format"], cfg["kv_format"]
    fmt = qf if qf == kvf else f"{qf}_2{kvf}"
    layout = {"none": None, "format": fmt, "name": cfg["expected_layout"]}[cfg["layout_arg"]]
    kw = dict(causal=cfg["causal"] != "none", bottom_right=cfg["causal"] == "bottom_right",
              softmax_scale=cfg["softmax_scale"], layout=layout, return_lse=cfg["return_lse"], p_format=cfg["p_format"])
    if qf == "thd":
        cu = cfg["cu"]
        for arg, key in (("cu_seqlens_q", "cu_q"), ("cu_seqlens_kv", "cu_kv")):
            c = ins[key]
            kw[arg] = [int(x) for x in c] if cu["where"] == "list" else \
                from_numpy(c.astype(np.int32 if cu["dtype"] == "int32" else np.int64), dev if cu["where"] == "same" else "cpu")
        if cfg["max_seqlen"] != "none":
            extra = cfg["max_extra"] if cfg["max_seqlen"] == "bound" else 0
            kw["max_seqlen_q"] = max(cfg["seqlens_q"]) + extra
            kw["max_seqlen_kv"] = max(cfg["seqlens_kv"]) + extra
    return ops, bases, kw, fmt


def _attention(cfg, ins, dev, mx):
    ops, bases, kw, fmt = _attention_args(cfg, ins, dev, mx)
    name = np.frombuffer(mx.qkv_layout(ops["q"], ops["k"], ops["v"], fmt).encode(), np.uint8).copy()
    out = {"layout": Out(name, (name.size,), "uint8", 1)}  # TransformerEngine's name of the memory
    r = mx.attention(ops["q"], ops["k"], ops["v"], **kw)
    o, lse = r if cfg["return_lse"] else (r, None)
    out["o"] = out_of(o)
    if lse is not None:
        out["lse"] = out_of(lse)
    for k, b in bases.items():  # the inputs' buffers: what the op read must be unchanged
        out[k] = out_of(b)
    return out


def _attention_backward(cfg, ins, dev, mx):
    """dQ, dK, dV of (dO, Q, K, V, O, LSE) on `dev`, with O and LSE from the oracle's float64 forward
    of the same operands rounded once (oracle.backward_inputs: the same inputs for every device and
    the oracle), and the inputs' buffers."""
    from .oracle import backward_inputs

    torch = _torch()
    ops, bases, kw, _ = _attention_args(cfg, ins, dev, mx)
    o_bits, lse32 = backward_inputs(cfg, ins)
    o = to_tensor(Arr.contiguous(o_bits, "bfloat16"), dev)[0]
    lse = torch.from_numpy(np.ascontiguousarray(lse32)).to(dev)
    do = cfg["do"]
    if do["mx"]:
        x, _ = to_tensor(ins["do.src"], dev)
        d_o = mx.quantize_attention(x, layout=cfg["q_format"], rowwise=True, columnwise=True,
                                    fp8_format=cfg["fp8_format"])
    else:
        d_o, bases["do.base"] = to_tensor(ins["do.x"], dev)  # (its view into its whole buffer)
    bkw = {k: x for k, x in kw.items() if k not in ("return_lse", "p_format")}
    dq, dk, dv = mx.attention_backward(d_o, ops["q"], ops["k"], ops["v"], o, lse, deterministic=cfg["deterministic"],
                                       **bkw)
    out = {"dq": out_of(dq), "dk": out_of(dk), "dv": out_of(dv)}
    for k, b in bases.items():
        out[k] = out_of(b)
    return out


def _gemm(cfg, ins, dev, mx):
    store, bases, ops = {}, {}, {}
    for name in ("a", "b"):
        op = cfg[name]
        if cfg["prec"] == "bf16":
            t, base = to_tensor(ins[f"{name}.x"], dev)
            ops[name], bases[f"{name}.base"] = t, base
        else:
            ops[name], b = _mx_operand(cfg, op, ins, name, op["read"] == "rowwise", dev, mx, store)
            bases.update(b)
    kw = dict(trans_a=cfg["trans_a"], trans_b=cfg["trans_b"], alpha=cfg["alpha"])
    out = {}
    if cfg["out"] == "alloc":
        if cfg["out_dtype"] is not None:
            kw["out_dtype"] = cfg["out_dtype"]
        d = mx.gemm(ops["a"], ops["b"], **kw)
    else:
        o, obase = to_tensor(ins["out"], dev)
        d = mx.gemm(ops["a"], ops["b"], out=o, accumulate=cfg["accumulate"], **kw)
        if d is not o and (d.data_ptr() != o.data_ptr() or tuple(d.stride()) != tuple(o.stride())):
            raise OpError("with out given, gemm did not return it")
        ob = out_of(obase)  # the bytes of out's buffer outside the view: untouched
        cov = np.repeat(ins["out"].view.covered(), ob.itemsize)
        out["out_outside"] = Out(ob.raw[~cov].copy(), (int((~cov).sum()),), "uint8", 1)
    out["d"] = out_of(d)
    for k, b in bases.items():
        out[k] = out_of(b)
    return out


RUNNERS = {
    "quantize": _quantize,
    "dequantize": _dequantize,
    "swizzle_scales": _swizzle,
    "unswizzle_scales": _swizzle,
    "quantize_attention": _quantize_attention,
    "attention_scales_to_bhsd": _attention_scales_to_bhsd,
    "to_bhsd": _to_bhsd,
    "apply_rope": _rope,
    "rope_backward": _rope,
    "rope_backward_quantize": _rope_backward_quantize,
    "fused_q_uproj_rope_quant": _fused,
    "attention": _attention,
    "attention_backward": _attention_backward,
    "gemm": _gemm,
}


def run(cfg: dict, ins: dict, device: str) -> dict:
    """Outputs of `cfg` on `device` ("cpu" or "cuda[:i]") as {name: Out}; an exception raised by
    the library becomes OpError with its type and message."""
    import mxmla

    poison_allocator(device)
    try:
        if device.startswith("cuda") and cfg.get("stream") == "side":
            torch = _torch()
            side = _side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                out = RUNNERS[cfg["op"]](cfg, ins, device, mxmla)
        else:
            out = RUNNERS[cfg["op"]](cfg, ins, device, mxmla)
        _sync(device)
    except OpError:
        raise
    except Exception as e:  # noqa: BLE001 — any failure of the library is a result to report
        raise OpError(f"{type(e).__name__}: {e}") from e
    _inject(cfg, device, out)
    return out


def _inject(cfg: dict, device: str, out: dict) -> None:
    """Fault injection, to see the fuzzers fail (tests, or a check of the reporting on a new
    machine): MXMLA_FUZZ_INJECT=op:output[:device] flips the low bit of the middle byte of that
    output of that op's runs (on that device only, when given: cpu / cuda)."""
    spec = os.environ.get("MXMLA_FUZZ_INJECT")
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] != cfg["op"] or len(parts) < 2 or parts[1] not in out:
        return
    if len(parts) > 2 and not device.startswith(parts[2]):
        return
    o = out[parts[1]]
    if o.raw.size:
        o.raw[o.raw.size // 2] ^= 1


def out_from_bits(bits: np.ndarray, dtype: str) -> Out:
    """An expected output (bits of `dtype`, logical shape) as an Out."""
    bits = np.ascontiguousarray(bits).astype(fp.BITS[dtype], copy=False)
    return Out(bits.reshape(-1).view(np.uint8).copy(), tuple(bits.shape), dtype, fp.ITEMSIZE[dtype])
