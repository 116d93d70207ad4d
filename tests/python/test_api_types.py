"""The typed option path and the package's shape: the C++ enums and option structs are bound (fields
read / write), the ops take an enum member wherever they take its spelling, the allowed spellings
come from the enums, the op modules never import back from the package __init__, the public API
carries type hints and the package ships py.typed."""
import ast
import inspect
import os
import re
import typing

import numpy as np
import pytest

import mxmla
from mxmla import _mxmla_core as core

PKG = os.path.dirname(mxmla.__file__)


def test_enums_are_bound_with_the_python_spellings():
    assert list(core.Fp8Format.__members__) == ["e4m3", "e5m2"]
    assert list(core.ScaleLayout.__members__) == ["compact", "swizzled", "bhsd"]
    assert list(core.QKVLayout.__members__) == ["sbhd", "bshd"]
    assert list(core.RopeStyle.__members__) == ["interleaved_in_halves_out", "interleaved", "rotate_half"]
    assert list(core.RopeLayout.__members__) == ["sbhd", "bshd", "thd"]
    assert list(core.WeightLayout.__members__) == ["nk", "kn"]
    assert mxmla.STYLES == tuple(core.RopeStyle.__members__)
    assert mxmla.Fp8Format is core.Fp8Format and mxmla.YarnParams is core.YarnParams


def test_option_structs_have_read_write_fields():
    o = core.QuantizeOptions()
    assert (o.rowwise, o.columnwise, o.format, o.swizzle) == (True, True, core.Fp8Format.e4m3, False)
    o.format, o.swizzle = core.Fp8Format.e5m2, True
    assert o.format == core.Fp8Format.e5m2 and "swizzle=True" in repr(o)
    a = core.AttentionQuantizeOptions()
    assert a.bhsd_scales is True and a.layout == core.QKVLayout.sbhd
    r = core.RopeBackwardQuantizeOptions()
    r.rope.style = core.RopeStyle.rotate_half  # the nested RopeOptions is writable in place
    r.rope.rope_dim = 32
    assert r.rope.style == core.RopeStyle.rotate_half and r.rope.rope_dim == 32
    q = core.QProjOptions()
    assert (q.nope_dim, q.rope_dim, q.batch, q.weight_layout) == (128, 64, 1, core.WeightLayout.nk)
    g = core.GemmOptions()
    assert (g.trans_a, g.trans_b, g.accumulate, g.alpha) == (False, True, False, 1.0)
    g.trans_b, g.alpha = False, 0.5
    assert "trans_b=False" in repr(g) and g.alpha == 0.5
    y = core.YarnParams.deepseek_v3()
    assert y.enabled and y.factor == 40.0 and y.original_max_position == 4096
    with pytest.raises(TypeError):
        o.format = "e4m3"  # the struct takes the enum: strings are parsed once, in the Python layer


def test_ops_take_enum_members_and_yarn_params():
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    a = mxmla.quantize(x, fp8_format=mxmla.Fp8Format.e5m2)
    b = mxmla.quantize(x, fp8_format="e5m2")
    assert a.fp8_format == "e5m2"
    np.testing.assert_array_equal(a.rowwise_data, b.rowwise_data)
    c1, s1 = mxmla.rope_tables(range(4), style=mxmla.RopeStyle.interleaved, yarn=mxmla.YarnParams.deepseek_v3())
    c2, s2 = mxmla.rope_tables(range(4), style="interleaved", yarn="deepseek_v3")
    np.testing.assert_array_equal(c1, c2)
    y = mxmla.apply_rope(np.ones((4, 1, 1, 64), np.float32), c1, s1, style=mxmla.RopeStyle.interleaved,
                         layout=mxmla.RopeLayout.sbhd)
    assert y.shape == (4, 1, 1, 64)


def test_op_modules_do_not_import_from_the_package_init():
    for name in ("rope.py", "qproj.py", "mxfp8.py", "gemm.py", "blockfp8.py", "_torch_ops.py", "_backend.py",
                 "_checks.py"):
        tree = ast.parse(open(os.path.join(PKG, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                names = [a.name for a in node.names]
                assert names == ["_mxmla_core"] or all(n in ("mxfp8", "rope", "qproj", "blockfp8", "_dispatch") for n in names), \
                    (name, names)


def test_no_long_positional_string_lists_in_the_bindings():
    """Each binding takes descriptors plus one options struct (or the enum it needs)."""
    for fn, opts in ((core.quantize, "QuantizeOptions"), (core.quantize_attention, "AttentionQuantizeOptions"),
                     (core.dequantize, "DequantizeOptions"), (core.apply_rope, "RopeOptions"),
                     (core.rope_backward, "RopeOptions"), (core.rope_backward_quantize, "RopeBackwardQuantizeOptions"),
                     (core.fused_q_uproj_rope_quant, "QProjOptions"), (core.gemm, "GemmOptions"),
                     (core.quantize_blockwise, "BlockQuantizeOptions"),
                     (core.fused_q_uproj_rope_quant_block, "QProjOptions")):
        desc = "tuple[int, str, collections.abc.Sequence[int], collections.abc.Sequence[int], int, int]"
        sig = fn.__doc__.split("->")[0].replace(desc, "Desc")
        assert f"options: mxmla._mxmla_core.{opts}" in sig, fn.__name__
        # after the options: an optional cu_seqlens descriptor and the stream, no str / bool
        rest = sig.split(f"options: mxmla._mxmla_core.{opts}")[1]
        assert not re.search(r"\b(str|bool)\b", rest), fn.__name__


PUBLIC = ["quantize", "dequantize", "swizzle_scales", "unswizzle_scales", "quantize_attention",
          "attention_scales_to_bhsd", "to_bhsd", "apply_rope", "rope_backward", "rope_backward_quantize", "rope_tables",
          "rope_inv_freq", "yarn_softmax_scale", "positions_arange", "positions_from_cu_seqlens",
          "positions_context_parallel", "fused_q_uproj_rope_quant", "gemm", "info", "quantize_blockwise"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_functions_carry_type_hints(name):
    fn = getattr(mxmla, name)
    sig = inspect.signature(fn)
    assert sig.return_annotation is not inspect.Signature.empty, name
    for p in sig.parameters.values():
        assert p.annotation is not inspect.Parameter.empty, (name, p.name)
    typing.get_type_hints(fn)  # the annotations resolve at run time too


def test_array_hints_name_torch_and_numpy_for_type_checkers():
    src = open(os.path.join(PKG, "mxfp8.py")).read()
    assert "if TYPE_CHECKING:" in src and "Union[_torch_t.Tensor, np.ndarray]" in src
    assert "x: Array" in inspect.getsource(mxmla.quantize)


def test_py_typed_marker_ships_with_the_package():
    assert os.path.isfile(os.path.join(PKG, "py.typed"))


def test_rope_tables_unpack_and_carry_their_style():
    t = mxmla.rope_tables(range(5), style="rotate_half")
    cos, sin = t
    assert isinstance(t, mxmla.RopeTables) and t.style == "rotate_half" and t.cos is cos and t.sin is sin
    assert mxmla.table_style(cos) == "rotate_half" and mxmla.table_style(cos[:2]) == "rotate_half"
    assert isinstance(cos, np.ndarray) and "rotate_half" in repr(t)
    assert mxmla.table_style(np.asarray(cos)) is None  # a plain array is taken as it is
