"""Recipes, Linear, RMSNorm and SwiGLU (DeepSeek-V3's dense MLP) for mxmla.nn.

Precision (recipe "bf16"; recipe "mxfp8": every Linear on mxmla's MXFP8 GEMM, MXFP8LinearFunction;
recipe "block-fp8": every Linear on the block-FP8 GEMM, BlockFP8LinearFunction, DeepSeek-V3's own
recipe): parameters are kept in fp32 (the optimizer's master copy); every Linear
casts its input and weight to the compute dtype (bf16) and runs one GEMM with fp32 accumulation;
RMSNorm computes in fp32 and returns its input's dtype. ``dtype=torch.float32`` / ``torch.float64``
run the same graph at that precision (reference checks; float64 also keeps its parameters in
float64).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .tp import UnshardedStateDict, copy_to_tp, gather_from_sp, keep_shards, reduce_from_tp, reduce_scatter_to_sp, \
    tp_size_rank

RECIPES = ("bf16", "mxfp8", "block-fp8")

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_recipe(recipe: str, what: str) -> str:
    """The recipe's name, or a ValueError naming the known ones."""
    if recipe not in RECIPES:
        raise ValueError(f"{what}: recipe must be one of {', '.join(map(repr, RECIPES))}, got {recipe!r}")
    return recipe


def fp8_attention_of(what: str, recipe: str, fp8_attention) -> bool:
    """Whether a recipe's attention runs in MXFP8: None -> the recipe's own (only "mxfp8"'s is); False
    -> bf16 under any recipe; True -> needs "mxfp8". A TypeError / ValueError naming the argument else."""
    if fp8_attention is None:
        return recipe == "mxfp8"
    check_bool(what, "fp8_attention", fp8_attention)
    if fp8_attention and recipe != "mxfp8":
        raise ValueError(f"{what}: fp8_attention=True needs recipe 'mxfp8' (MXFP8 attention); recipe {recipe!r} "
                         "runs its attention in bf16")
    return fp8_attention


def check_bool(what: str, name: str, value) -> bool:
    """value, or a TypeError naming the argument when it is not a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__}")
    return value


# The weights' FP8 copies are cached per generation and version of each weight. The version counter
# misses writes that bypass it: FSDP2 all-gathers into its unsharded parameters under
# torch.autograd._unsafe_preserve_version_counter (the same tensor, often the same address, new
# values), and a write through `.data` (Megatron copies its fp32 main parameters into the model's so)
# has a counter of its own. So every torch optimizer's step starts a new generation (a global step
# hook), as does invalidate_weight_caches() for code that changes weights some other way.
_GENERATION = [0]


def invalidate_weight_caches() -> None:
    """Makes every Linear quantize its weight afresh at its next call (after a weight change that
    neither a torch optimizer's step nor an in-place update of the parameter made, e.g. one written
    through ``param.data``). Every torch optimizer's ``step()`` does this by itself."""
    _GENERATION[0] += 1


register_optimizer_step_post_hook(lambda *_args, **_kwargs: invalidate_weight_caches())


def _per_version(weight: torch.Tensor, attr: str, make):
    """make(weight), cached on the weight under attr once per generation and version of it (see
    _GENERATION): micro-batches between two optimizer steps reuse it. While a CUDA graph is being
    captured it is made afresh and not cached: the graph then holds the work, which each replay
    redoes on the weight as it is then (replays run no Python, so a version check at capture would
    freeze one copy of the weight into every replay). A weight once read inside a capture is not
    cached afterwards either: a replay may update it (a captured optimizer step) without a new
    version or generation, and an eager call between replays (an evaluation) must see that."""
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        weight._mxmla_in_graph = True
        return make(weight.detach())
    if getattr(weight, "_mxmla_in_graph", False):
        return make(weight.detach())
    key = (_GENERATION[0], weight._version, weight.device, weight.data_ptr())
    cached = getattr(weight, attr, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = make(weight.detach())
    setattr(weight, attr, (key, value))
    return value


def _quantized_weight(weight: torch.Tensor):
    """W's MXFP8 copies (both directions), quantized once per version of the weight."""
    import mxmla

    return _per_version(weight, "_mxmla_mxfp8", lambda w: mxmla.quantize(w.to(torch.bfloat16)))


def _rows_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [.., K] as the contiguous bf16 [T, K] matrix a Linear quantizes (a view where x already is one)."""
    return x.detach().reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()


def _is_own_rows(x: torch.Tensor, x2: torch.Tensor) -> bool:
    """Whether x2, x's [T, K] bf16 rows as a Linear reads them, is x's own memory (no copy was made):
    then a Linear with save_original_input can keep x2 instead of a quantized copy."""
    return x2.is_contiguous() and x2.data_ptr() == x.data_ptr()


def linear_saved(x8, w8) -> tuple:
    """What an MXFP8 Linear's backward reads (as the reference system keeps: x's and W's columnwise
    copies), for save_for_backward."""
    return x8.columnwise_data, x8.columnwise_scale_inv, w8.columnwise_data, w8.columnwise_scale_inv


def linear_saved_frozen(w8) -> tuple:
    """linear_saved's form for a Linear whose weight takes no gradient: W's columnwise copy only."""
    return None, None, w8.columnwise_data, w8.columnwise_scale_inv


def linear_saved_original(x2: torch.Tensor, w8) -> tuple:
    """linear_saved's form for a Linear that keeps its bf16 input x2 [T, K] itself (save_original_input):
    x's columnwise copy is quantized from it when the wgrad runs (the same bits)."""
    return x2, None, w8.columnwise_data, w8.columnwise_scale_inv


def linear_grads(saved, shapes, weight: torch.Tensor, dy, deferred: bool = False, need_dx: bool = True,
                 need_dw: bool = True):
    """(dx bf16 [T, K] or None, dW in the weight's dtype or None) of an MXFP8 Linear from linear_saved's
    (or linear_saved_original's) tensors and the (x, W) shapes: ``mxmla.linear_backward`` (dy: a [T, N]
    tensor or its pair form), the wgrad added into the weight's ``main_grad`` (Megatron's fp32 buffer;
    then no dW) when it has one. deferred: (dx, a function computing that dW later), dy a [T, N]
    tensor; the same bits (dy quantized once, then ``mxmla.gemm``'s dgrad now and its wgrad on dY's
    columnwise copy later). need_dx / need_dw false: that GEMM is skipped (an input without a
    gradient; a frozen weight, whose saved x copy may then be None: dY is quantized rowwise only)."""
    import mxmla

    xc, xs, wc, ws = saved
    w8 = mxmla.MXFP8Tensor(shapes[1], "e4m3", "compact", None, None, wc, ws)
    if not need_dw:  # a frozen weight: the dgrad alone, on dY's rowwise copy (the same bits)
        if not need_dx:
            return None, None
        if isinstance(dy, tuple):  # the pair form: its [T, h·(d0 + d1)] rows, made here
            dy = torch.cat(dy, dim=-1).reshape(dy[0].shape[0], -1)
        return mxmla.gemm(mxmla.quantize(dy, rowwise=True, columnwise=False), w8, trans_b=False), None

    def x_columnwise():
        if xs is None:  # the bf16 x itself: its columnwise copy, made now
            return mxmla.quantize(xc, rowwise=False)
        return mxmla.MXFP8Tensor(shapes[0], "e4m3", "compact", None, None, xc, xs)

    if not deferred:
        main_grad = getattr(weight, "main_grad", None)
        dx, dw = mxmla.linear_backward(dy, w8, x_columnwise(), need_dx=need_dx, main_grad=main_grad)
        return dx, (None if main_grad is not None else dw.to(weight.dtype))
    dy8 = mxmla.quantize(dy, rowwise=need_dx)  # dgrad's rowwise copy, wgrad's columnwise copy
    dx = mxmla.gemm(dy8, w8, trans_b=False) if need_dx else None
    dyc = mxmla.MXFP8Tensor(dy8.shape, "e4m3", "compact", None, None, dy8.columnwise_data, dy8.columnwise_scale_inv)
    del dy8

    def wgrad():
        main_grad = getattr(weight, "main_grad", None)
        x8 = x_columnwise()
        if main_grad is not None:
            mxmla.gemm(dyc, x8, trans_a=True, trans_b=False, out=main_grad, accumulate=True)
            return None
        return mxmla.gemm(dyc, x8, trans_a=True, trans_b=False, out_dtype=torch.float32).to(weight.dtype)

    return dx, wgrad


class _WgradAnchor(torch.autograd.Function):
    """The node that runs a DeferredWgrad's GEMM: forward returns an empty token that the Linear
    takes as an input; backward, reached after the Linear's backward has put its wgrad in the box
    (and passed the token an empty gradient), runs it and returns the weight's gradient."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        dws = [d for d in (f() for f in ctx.box) if d is not None]  # one per backward of the Linear's node
        ctx.box.clear()
        return (sum(dws[1:], dws[0]) if dws else None), None


class DeferredWgrad:
    """A Linear's weight gradient moved after the rest of its block's backward (what Megatron and
    TransformerEngine call delayed wgrad, here without an explicit call). Made by
    ``Linear.deferred_wgrad()`` before the block's other operations are recorded, and passed to the
    Linear's call (``linear(x, wgrad=handle)``): the Linear's backward computes dX at once and leaves
    the dW GEMM, with the quantized dYᵀ and xᵀ it reads, in the handle's box; the GEMM runs in the
    backward of an anchor node recorded when the handle was made. Autograd's engine runs, of the
    nodes ready to run, the one recorded last first, so the anchor runs after every node recorded
    after it that the gradient reaches — the rest of the block's backward: the weight's gradient
    (fp32, 4·N·K bytes) is allocated after the block's memory peak instead of before it. The same
    bits as without it; the gradient lands in .grad, or in main_grad, as usual."""

    __slots__ = ("box", "token")

    def __init__(self, weight: torch.Tensor):
        self.box: list = []
        self.token = _WgradAnchor.apply(weight, self.box)


class MXFP8LinearFunction(torch.autograd.Function):
    """y = x · Wᵀ as TransformerEngine's MXFP8 recipe runs a Linear (SPEC §6), on mxmla.gemm.

    forward: x [T, K] and W [N, K] cast to bf16 and quantized to MXFP8 (E4M3); fprop Y = X_row · W_rowᵀ
    (bf16 out, fp32 accumulation). Saved: x's columnwise copy and W's columnwise copy only.
    backward: dY quantized (both copies); dgrad dX = dY_row · W_col (bf16), wgrad dW = dY_colᵀ · X_col
    (fp32, the master weight's dtype). K and N must be multiples of 32 (the rowwise copies' blocks); T
    any (the columnwise tail block). A weight with a ``main_grad`` attribute (an fp32 tensor of its
    shape, Megatron's gradient-accumulation buffer) gets the wgrad added into it (the GEMM's
    accumulate mode) and no ``.grad``. W's MXFP8 copies are made once per version of the weight
    (every micro-batch between two optimizer steps reuses them). x's and dY's quantization run fused
    into the GEMMs (``mxmla.linear_forward`` / ``linear_backward``: the bits of quantize + gemm, with
    one pass over x or dY writing the bf16 values the GEMMs read). save_original_input
    (TransformerEngine's option of that name): x itself is saved instead of its columnwise copy when x
    is a bf16 tensor whose [T, K] rows are its own memory (another node saves it anyway, as attention
    saves its output O for the output projection), and the copy is quantized from it when the wgrad
    runs; otherwise the columnwise copy is saved as usual. x_quantized: x's MXFP8 copies (both
    directions) made once for the Linears that read the same x (``Linear.quantize_input``): fprop
    reads the rowwise copy (``mxmla.gemm``), and the columnwise copy they save is one tensor. A weight
    that takes no gradient (frozen, as in fine-tuning): no copy of x is kept and no wgrad runs; an x
    without a gradient: no dgrad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, token: Optional[torch.Tensor] = None,
                box: Optional[list] = None, save_original_input: bool = False,
                x_quantized: Optional[Any] = None) -> torch.Tensor:
        import mxmla

        lead, K = x.shape[:-1], x.shape[-1]
        ctx.box = box  # a DeferredWgrad's (with its token): the wgrad runs later, in its anchor's backward
        w8 = _quantized_weight(weight)
        ctx.lead = lead
        ctx.weight = weight  # for its main_grad (Megatron's fp32 gradient buffer), when it has one
        need_dw = ctx.needs_input_grad[1]  # a frozen weight: no wgrad, so no copy of x is kept
        if x_quantized is not None:  # made once for the Linears that read the same x (save_original_input moot)
            y = mxmla.gemm(x_quantized, w8)
            ctx.save_for_backward(*(linear_saved(x_quantized, w8) if need_dw else linear_saved_frozen(w8)))
            ctx.shapes = (tuple(x_quantized.shape), w8.shape)
            return y.reshape(*lead, y.shape[-1])
        x2 = x.detach().reshape(-1, K).to(torch.bfloat16)
        if x2.stride(-1) != 1:  # (linear_forward reads rows of any stride, each row contiguous)
            x2 = x2.contiguous()
        y, x8 = mxmla.linear_forward(x2, w8)
        if not need_dw:
            del x8
            ctx.save_for_backward(*linear_saved_frozen(w8))
        elif save_original_input and _is_own_rows(x, x2):
            del x8  # x itself is kept (another node saves it anyway): x's columnwise copy is made at wgrad time
            ctx.save_for_backward(*linear_saved_original(x2, w8))
        else:
            ctx.save_for_backward(*linear_saved(x8, w8))  # only the copies the backward reads
        ctx.shapes = ((x2.shape[0], K), w8.shape)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16).contiguous()
        deferred = ctx.box is not None and ctx.needs_input_grad[2]
        dx, dw = linear_grads(ctx.saved_tensors, ctx.shapes, ctx.weight, dy2, deferred,
                              need_dx=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1])  # dx [T, K] bf16
        dx = None if dx is None else dx.reshape(*ctx.lead, dx.shape[-1])
        return (dx,) + _wgrad_outputs(ctx, dw, deferred) + (None, None)


def _wgrad_outputs(ctx, dw, deferred: bool) -> tuple:
    """The gradients of (weight, token, box) of a Linear function: dW, or with a DeferredWgrad, the
    wgrad put in its box and an empty gradient for its token (which lets the anchor run)."""
    if not deferred:
        return dw, None, None
    ctx.box.append(dw)
    return None, ctx.weight.new_empty(0), None


def block_weights(weight: torch.Tensor):
    """W's block-FP8 copies (128 x 128 blocks, power-of-two scales, quantized from the fp32 master
    weight): (W [N, K], Wᵀ [K, N]), the fprop and dgrad operands (the same blocks, so the same scales;
    the codes transposed), made in one pass once per version of the weight."""
    import mxmla

    return _per_version(weight, "_mxmla_block_fp8", lambda w: mxmla.quantize_blockwise_both(w.float(), block_rows=128))


def block_linear_grads(dy: torch.Tensor, wt, xt, weight: torch.Tensor, need_dx: bool = True,
                       deferred: bool = False, need_dw: bool = True):
    """(dx bf16 [T, K] or None, dW fp32 [N, K] or None) of a block-FP8 Linear (SPEC §4.1): dy [T, N]
    quantized in 1 x 128 blocks along N (dgrad's A) and along T (wgrad's A, dyᵀ); dgrad dX = dY·W on
    Wᵀ's copy ``wt`` [K, N], wgrad dW = dYᵀ·X on xᵀ's copy ``xt`` [K, T] (or a function making it,
    called when the wgrad runs), added into the weight's ``main_grad`` (Megatron's fp32 buffer; then
    no dW) when it has one. deferred: (dx, a function computing that dW later, from dyᵀ's codes).
    need_dw false (a frozen weight; xt may be None): the dgrad alone, dY quantized along N only."""
    import mxmla

    if not need_dw:
        return (mxmla.gemm(mxmla.quantize_blockwise(dy), wt) if need_dx else None), None
    if need_dx:  # dY along N and along T in one pass
        dyq, dyt = mxmla.quantize_blockwise_both(dy)
        dx = mxmla.gemm(dyq, wt)
        del dyq
    else:
        dx, dyt = None, mxmla.quantize_blockwise(dy, transpose=True)

    def wgrad():
        main_grad = getattr(weight, "main_grad", None)
        xt_ = xt() if callable(xt) else xt
        if main_grad is not None:
            mxmla.gemm(dyt, xt_, out=main_grad, accumulate=True)
            return None
        return mxmla.gemm(dyt, xt_, out_dtype=torch.float32).to(weight.dtype)

    return dx, (wgrad if deferred else wgrad())


class BlockFP8LinearFunction(torch.autograd.Function):
    """y = x · Wᵀ as DeepSeek-V3 trains its Linears (TransformerEngine's Float8BlockScaling; SPEC
    §4.1), on mxmla.gemm's block-FP8 kernel (Hopper's FP8 tensor cores).

    forward: x [T, K] cast to bf16 and quantized in 1 x 128 blocks (E4M3, power-of-two scales) along K
    (fprop's operand) and along T (xᵀ, wgrad's), W [N, K] in 128 x 128 blocks (once per version of the
    weight, with its transpose for dgrad); fprop Y = X · Wᵀ (bf16 out, fp32 accumulation). Saved: xᵀ's
    codes and scales only, or with save_original_input (TransformerEngine's option of that name) x
    itself when x is a bf16 tensor whose [T, K] rows are its own memory (another node saves it
    anyway, as attention saves its output O for the output projection): x is then quantized along
    K only in the forward, and along T when the wgrad runs. backward: dY quantized the same two
    ways; dgrad dX = dY · W (bf16), wgrad dW = dYᵀ · X (fp32, or added into the weight's
    ``main_grad``). Any T, K, N. A frozen weight (no gradient): x along K only, nothing of it kept, no
    wgrad; an x without a gradient: no dgrad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, token: Optional[torch.Tensor] = None,
                box: Optional[list] = None, x_quantized: Optional[tuple] = None,
                save_original_input: bool = False) -> torch.Tensor:
        import mxmla

        lead = x.shape[:-1]
        ctx.box = box  # a DeferredWgrad's (with its token): the wgrad runs later, in its anchor's backward
        wq, wt = block_weights(weight)
        x2 = None if x_quantized is not None else _rows_bf16(x)
        ctx.frozen = not ctx.needs_input_grad[1]  # a weight without a gradient: no xᵀ, nothing of x kept
        ctx.original = save_original_input and x2 is not None and _is_own_rows(x, x2) and not ctx.frozen
        if ctx.frozen:
            xq = mxmla.quantize_blockwise(x2) if x2 is not None else x_quantized[0]
        elif ctx.original:  # fprop's x now; wgrad's xᵀ from x, later
            xq = mxmla.quantize_blockwise(x2)
            ctx.save_for_backward(x2)
        else:
            if x2 is not None:  # fprop's x and wgrad's xᵀ, one pass over x
                xq, xt = mxmla.quantize_blockwise_both(x2)
            else:  # made once for the Linears that read the same x (Linear.quantize_input)
                xq, xt = x_quantized
            ctx.save_for_backward(xt.data, xt.scale_inv)
        y = mxmla.gemm(xq, wq)
        ctx.lead, ctx.weight, ctx.wt = lead, weight, wt  # (Wᵀ's copy: held by the weight's cache anyway)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        import mxmla

        saved = ctx.saved_tensors
        if ctx.frozen:
            xt = None
        elif ctx.original:
            xt = functools.partial(mxmla.quantize_blockwise, saved[0], transpose=True)
        else:
            xt = mxmla.BlockFP8Tensor(saved[0], saved[1], 1)
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16).contiguous()
        deferred = ctx.box is not None and ctx.needs_input_grad[2]
        dx, dw = block_linear_grads(dy2, ctx.wt, xt, ctx.weight, ctx.needs_input_grad[0], deferred,
                                    need_dw=not ctx.frozen)
        dx = None if dx is None else dx.reshape(*ctx.lead, dx.shape[-1])
        return (dx,) + _wgrad_outputs(ctx, dw, deferred) + (None, None)


def resolve_dtypes(what: str, dtype: torch.dtype, params_dtype: Optional[torch.dtype]) -> Tuple[torch.dtype, torch.dtype]:
    """(compute dtype, parameter dtype): parameters in fp32 unless the compute dtype is float64."""
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"{what}: dtype must be torch.bfloat16, float16, float32 or float64, got {dtype}")
    if params_dtype is None:
        params_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if params_dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"{what}: params_dtype must be torch.float32, float64 or bfloat16, got {params_dtype}")
    return dtype, params_dtype


def init_normal_(p: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """N(0, std) drawn in float32 on the CPU from `generator`, then copied: the same seed gives the
    same weights whatever the parameter's dtype or device."""
    w = torch.empty(p.shape, dtype=torch.float32)
    nn.init.normal_(w, 0.0, std, generator=generator)
    with torch.no_grad():
        p.copy_(w)


def generator(seed: int) -> torch.Generator:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"mxmla.nn: seed must be an int, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def child_seed(g: torch.Generator) -> int:
    """A seed for a submodule, drawn from its parent's generator."""
    return int(torch.randint(0, 2**62, (1,), generator=g))


class Linear(nn.Module):
    """y = x · Wᵀ, W [out_features, in_features], no bias (DeepSeek-V3's linears have none).

    recipe "bf16": input and weight cast to `dtype`, one GEMM with fp32 accumulation, output in
    `dtype`. recipe "mxfp8": MXFP8LinearFunction (x and W quantized to MXFP8 with both copies, the
    three GEMMs on mxmla.gemm, bf16 output and input gradient, fp32 weight gradient); in_features
    and out_features must be multiples of 32, and the compute dtype is bf16. recipe "block-fp8":
    BlockFP8LinearFunction (DeepSeek-V3's recipe: x and dY in 1 x 128 blocks, W in 128 x 128 blocks,
    the three GEMMs on the FP8 tensor cores); any in_features and out_features, compute dtype bf16."""

    def __init__(self, in_features: int, out_features: int, recipe: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 params_dtype: Optional[torch.dtype] = None, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        self.recipe = check_recipe(recipe, "mxmla.nn.Linear")
        self.dtype, params_dtype = resolve_dtypes("mxmla.nn.Linear", dtype, params_dtype)
        self.in_features, self.out_features, self.init_std = int(in_features), int(out_features), float(init_std)
        if recipe in ("mxfp8", "block-fp8") and self.dtype != torch.bfloat16:
            raise ValueError(f"mxmla.nn.Linear: recipe {recipe!r} computes in bf16 (dtype=torch.bfloat16), got "
                             f"{self.dtype}")
        if recipe == "mxfp8":
            for name, n in (("in_features", self.in_features), ("out_features", self.out_features)):
                if n % 32:
                    raise ValueError(f"mxmla.nn.Linear: recipe 'mxfp8' needs {name} to be a multiple of 32 (the MXFP8 "
                                     f"blocks of the GEMMs' rowwise copies), got {n}")
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=params_dtype))
        self.reset_parameters(generator(seed))

    def reset_parameters(self, g: torch.Generator) -> None:
        init_normal_(self.weight, self.init_std, g)

    def forward(self, x: torch.Tensor, wgrad: Optional[DeferredWgrad] = None,
                x_quantized: Optional[Any] = None, save_original_input: bool = False) -> torch.Tensor:
        """y = x · Wᵀ. wgrad: this Linear's ``deferred_wgrad()`` handle, made earlier in the block's
        forward (the weight gradient then runs after the block's backward; FP8 recipes). x_quantized:
        under the FP8 recipes, ``quantize_input(x)`` of this very x, shared by the Linears that read it.
        save_original_input: under the FP8 recipes, keep a reference to x for the wgrad instead of its
        quantized copy (for an x that another node saves anyway; see MXFP8LinearFunction and
        BlockFP8LinearFunction)."""
        if wgrad is not None and not isinstance(wgrad, DeferredWgrad):
            raise TypeError(f"mxmla.nn.Linear: wgrad must be a DeferredWgrad from deferred_wgrad(), got "
                            f"{type(wgrad).__name__}")
        for name, v in (("x_quantized", x_quantized is not None),
                        ("save_original_input", check_bool("mxmla.nn.Linear", "save_original_input",
                                                           save_original_input))):
            if v and self.recipe == "bf16":
                raise ValueError(f"mxmla.nn.Linear: {name} is for the FP8 recipes ('mxfp8', 'block-fp8'), not 'bf16'")
        if x_quantized is not None:
            self._check_x_quantized(x, x_quantized)
        token, box = (None, None) if wgrad is None else (wgrad.token, wgrad.box)
        if self.recipe == "mxfp8":
            return MXFP8LinearFunction.apply(x, self.weight, token, box, save_original_input, x_quantized)
        if self.recipe == "block-fp8":
            return BlockFP8LinearFunction.apply(x, self.weight, token, box, x_quantized, save_original_input)
        return F.linear(x.to(self.dtype), self.weight.to(self.dtype))

    def deferred_wgrad(self) -> Optional[DeferredWgrad]:
        """A DeferredWgrad for this Linear's next call (see there), or None where the weight gradient
        runs as usual: recipe "bf16" (plain torch), no gradient recorded, or while torch.compile
        traces (its graph orders the backward itself)."""
        if (self.recipe == "bf16" or not torch.is_grad_enabled() or not self.weight.requires_grad
                or torch.compiler.is_compiling()):
            return None
        return DeferredWgrad(self.weight)

    def quantize_input(self, x: torch.Tensor) -> Any:
        """x quantized once for the Linears that read it, to pass to each as ``x_quantized`` (one pass
        over x, one saved copy): under "block-fp8" its (X, Xᵀ) block-FP8 copies (1 x 128 blocks along K
        and along T), under "mxfp8" its MXFP8Tensor with both copies (E4M3, compact scales)."""
        import mxmla

        if self.recipe == "bf16":
            raise ValueError("mxmla.nn.Linear.quantize_input: for the FP8 recipes ('mxfp8', 'block-fp8'), not 'bf16'")
        if self.recipe == "mxfp8":
            return mxmla.quantize(_rows_bf16(x))
        return tuple(mxmla.quantize_blockwise_both(_rows_bf16(x)))

    def _check_x_quantized(self, x: torch.Tensor, xq: Any) -> None:
        import mxmla

        T, K = math.prod(x.shape[:-1]), x.shape[-1]
        if self.recipe == "mxfp8":
            ok = (isinstance(xq, mxmla.MXFP8Tensor) and tuple(xq.shape) == (T, K) and xq.fp8_format == "e4m3"
                  and xq.scale_layout == "compact" and xq.rowwise_data is not None
                  and xq.columnwise_data is not None)
            want = f"an MXFP8Tensor [{T}, {K}] with both copies"
        else:
            ok = (isinstance(xq, tuple) and len(xq) == 2 and tuple(getattr(xq[0], "shape", ())) == (T, K)
                  and tuple(getattr(xq[1], "shape", ())) == (K, T))
            want = f"the block-FP8 pair (X [{T}, {K}], Xᵀ [{K}, {T}])"
        if not ok:
            raise ValueError(f"mxmla.nn.Linear: x_quantized must be quantize_input(x) of this x: {want}")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe!r}, dtype={self.dtype}"


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight over the last dim (DeepSeek-V3: eps 1e-6, weight ones).

    Computed in fp32 (float64 for float64 inputs); the result has the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)
        self.weight = nn.Parameter(torch.ones(self.dim, dtype=params_dtype))
        # sequence parallelism: the process group whose ranks each normalize a slice of the sequence;
        # the weight's gradient is then summed over them (Megatron's sequence-parallel norms)
        self.sequence_parallel_group: Any = None

    def reset_parameters(self, g: Optional[torch.Generator] = None) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = self.weight if self.sequence_parallel_group is None else copy_to_tp(self.weight, self.sequence_parallel_group)
        return F.rms_norm(x.to(ct), (self.dim,), w.to(ct), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class SwiGLU(UnshardedStateDict, nn.Module):
    """DeepSeek-V3's dense MLP: w2(silu(w1·x) ⊙ w3·x), each projection a Linear of the recipe.

    Under the FP8 recipes x is quantized once for w1 and w3 (``Linear.quantize_input``: one pass,
    one saved copy for their wgrads). delay_wgrad (default True; the FP8 recipes): w2's weight
    gradient runs after w1's and w3's backward (``DeferredWgrad``), so that its fp32 buffer is not
    allocated while the MLP's activations are still held. The same bits either way.

    tp_group: Megatron's tensor-parallel MLP: w1 and w3 keep this rank's rows (column parallel, an
    equal share of inter_dim), w2 the matching columns (row parallel, its partial outputs summed over
    the ranks in fp32); inter_dim must divide evenly (under "mxfp8" into multiples of 32). Every rank
    draws the full weights from `seed` and keeps its shards (the same model at any tp size).
    sequence_parallel: with tp_group, x and the output are this rank's slice of the sequence dim
    (``forward``'s seq_dim), all-gathered before w1 / w3 (the gradient reduce-scattered back) and
    reduce-scattered after w2."""

    def __init__(self, dim: int, inter_dim: int, recipe: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 params_dtype: Optional[torch.dtype] = None, init_std: float = 0.02,
                 out_init_std: Optional[float] = None, seed: int = 0, delay_wgrad: bool = True,
                 tp_group: Any = None, sequence_parallel: bool = False):
        super().__init__()
        what = "mxmla.nn.SwiGLU"
        check_recipe(recipe, what)
        self.recipe = recipe
        self.delay_wgrad = check_bool(what, "delay_wgrad", delay_wgrad)
        self.sequence_parallel = check_bool(what, "sequence_parallel", sequence_parallel)
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_rank(tp_group)
        if inter_dim % self.tp_size or (recipe == "mxfp8" and inter_dim // self.tp_size % 32):
            raise ValueError(f"{what}: inter_dim ({inter_dim}) must divide into the tensor-parallel size's "
                             f"({self.tp_size}) equal shares" + (" that are multiples of 32 (recipe 'mxfp8')"
                                                                 if recipe == "mxfp8" else ""))
        g = generator(seed)
        kw = dict(recipe=recipe, dtype=dtype, params_dtype=params_dtype)
        self.w1 = Linear(dim, inter_dim, init_std=init_std, seed=child_seed(g), **kw)
        self.w2 = Linear(inter_dim, dim, init_std=init_std if out_init_std is None else out_init_std,
                         seed=child_seed(g), **kw)
        self.w3 = Linear(dim, inter_dim, init_std=init_std, seed=child_seed(g), **kw)
        if self.tp_size > 1:
            keep_shards(self)

    def _sharded(self):
        """(Linear name, features per unit, sharded along the input (columns)?) of the sharded weights."""
        return [("w1", 1, False), ("w3", 1, False), ("w2", 1, True)]

    def forward(self, x: torch.Tensor, seq_dim: Optional[int] = None) -> torch.Tensor:
        """seq_dim: with sequence_parallel, the dim of x that holds this rank's slice of the sequence
        (default: 0 for a 2-D x, packed tokens; else 1, [b, s, dim])."""
        g = self.tp_group
        if self.sequence_parallel and self.tp_size > 1:
            seq_dim = (0 if x.dim() == 2 else 1) if seq_dim is None else seq_dim
            x = gather_from_sp(x, seq_dim, g, sum_grad=True)
        else:
            x = copy_to_tp(x, g)
        defer = self.w2.deferred_wgrad() if self.delay_wgrad else None  # its anchor recorded first
        xq = self.w1.quantize_input(x) if self.recipe != "bf16" and not torch.compiler.is_compiling() else None
        y = self.w2(F.silu(self.w1(x, x_quantized=xq)) * self.w3(x, x_quantized=xq), wgrad=defer)
        if self.sequence_parallel and self.tp_size > 1:
            return reduce_scatter_to_sp(y, seq_dim, g)
        return reduce_from_tp(y, g)


def default_inter_dim(hidden: int) -> int:
    """8/3 · hidden rounded up to a multiple of 64 (a SwiGLU of about a 4·hidden MLP's cost)."""
    return max(64, int(math.ceil(8 * hidden / 3 / 64)) * 64)
