"""Pretrained weights (mxmla.nn.pretrained) on the CPU: MLA and Block loaded from Hugging Face
DeepSeek-V2 / V3-style checkpoints compute what the checkpoint's own model computes (an independent
float64 transcription of Hugging Face's DeepSeek attention and decoder layer: its YaRN tables, the
permutation of q_pe / k_pe before a rotate-half RoPE, its softmax scale); FP8 weights load bit for
bit as DeepSeek's fp32 block dequantization; the three namings round-trip; bad checkpoints and
configs give clear errors."""
import json
import math

import pytest

torch = pytest.importorskip("torch")
mnn = pytest.importorskip("mxmla.nn")

F64 = torch.float64
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
# hidden 160: FP8 weights of two 128-column blocks, the second a tail
V3_LIKE = dict(hidden_size=160, num_attention_heads=3, q_lora_rank=48, kv_lora_rank=40, qk_nope_head_dim=16,
               qk_rope_head_dim=16, v_head_dim=24, rope_theta=10000.0, rms_norm_eps=1e-6, rope_scaling=YARN,
               intermediate_size=136)
V2_LITE_LIKE = dict(V3_LIKE, q_lora_rank=None, rope_theta=50000.0, rms_norm_eps=1e-5,
                    rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707))
# mscale != mscale_all_dim: Hugging Face scales its cos / sin tables by their ratio
UNEQUAL_MSCALE = dict(V3_LIKE, rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.5))
PLAIN_ROPE = dict(V3_LIKE, rope_scaling=None)
CONFIGS = {"v3": V3_LIKE, "v2-lite": V2_LITE_LIKE, "unequal-mscale": UNEQUAL_MSCALE, "plain": PLAIN_ROPE}
SEQ = 40  # past YaRN's original length (16)


# ------------------------------------------------------------------ Hugging Face's model, transcribed
def _get_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def hf_rope_cache(cfg, seq):
    """cos, sin [seq, rope] as DeepseekV3(Yarn)RotaryEmbedding makes them (in float64)."""
    dim, base, sc = cfg["qk_rope_head_dim"], cfg["rope_theta"], cfg["rope_scaling"]
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    m = 1.0
    inv = extra
    if sc is not None:
        f, orig = sc["factor"], sc["original_max_position_embeddings"]

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(corr(sc["beta_fast"])), 0), min(math.ceil(corr(sc["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
        mask = 1.0 - ramp
        inv = extra / f * (1 - mask) + extra * mask
        m = _get_mscale(f, sc["mscale"]) / _get_mscale(f, sc["mscale_all_dim"])
    fr = torch.outer(torch.arange(seq, dtype=F64), inv)
    emb = torch.cat([fr, fr], -1)
    return emb.cos() * m, emb.sin() * m


def hf_apply_rope(x, cos, sin):
    """x [b, h, s, d]: Hugging Face's apply_rotary_pos_emb for DeepSeek (pairs moved to halves first)."""
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos[:s] + torch.cat([-x2, x1], -1) * sin[:s]


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _lin(x, w):
    return x @ w.T


def hf_attention(sd, cfg, x, p=""):
    """DeepseekV3Attention's forward (eager, causal) on x [b, s, hidden], float64 weights sd."""
    b, s, _ = x.shape
    H, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    eps = cfg["rms_norm_eps"]
    if cfg["q_lora_rank"]:
        c_q = _rms(_lin(x, sd[p + "q_a_proj.weight"]), sd[p + "q_a_layernorm.weight"], eps)
        q = _lin(c_q, sd[p + "q_b_proj.weight"])
    else:
        q = _lin(x, sd[p + "q_proj.weight"])
    q = q.view(b, s, H, dn + dr).transpose(1, 2)
    q_nope, q_pe = q.split([dn, dr], -1)
    ckv, k_pe = _lin(x, sd[p + "kv_a_proj_with_mqa.weight"]).split([cfg["kv_lora_rank"], dr], -1)
    k_pe = k_pe.view(b, s, 1, dr).transpose(1, 2)
    kv = _lin(_rms(ckv, sd[p + "kv_a_layernorm.weight"], eps), sd[p + "kv_b_proj.weight"])
    k_nope, v = kv.view(b, s, H, dn + dv).transpose(1, 2).split([dn, dv], -1)
    cos, sin = hf_rope_cache(cfg, s)
    q_pe, k_pe = hf_apply_rope(q_pe, cos, sin), hf_apply_rope(k_pe, cos, sin)
    qs = torch.cat([q_nope, q_pe], -1)
    ks = torch.cat([k_nope, k_pe.expand(b, H, s, dr)], -1)
    scale = (dn + dr) ** -0.5
    sc = cfg["rope_scaling"]
    if sc is not None and sc.get("mscale_all_dim"):
        scale *= _get_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
    att = qs @ ks.transpose(-1, -2) * scale
    att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(b, s, H * dv)
    return _lin(o, sd[p + "o_proj.weight"])


def hf_layer(sd, cfg, x, p=""):
    """DeepseekV3DecoderLayer with a dense MLP."""
    eps = cfg["rms_norm_eps"]
    h = x + hf_attention(sd, cfg, _rms(x, sd[p + "input_layernorm.weight"], eps), p + "self_attn.")
    y = _rms(h, sd[p + "post_attention_layernorm.weight"], eps)
    gate, up = _lin(y, sd[p + "mlp.gate_proj.weight"]), _lin(y, sd[p + "mlp.up_proj.weight"])
    mlp = _lin(torch.nn.functional.silu(gate) * up, sd[p + "mlp.down_proj.weight"])
    return h + mlp


# ------------------------------------------------------------------ checkpoints
def hf_attention_shapes(cfg):
    H, dn, dr, dv, hid = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                            "hidden_size"))
    kvr, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    shapes = {}
    if qr:
        shapes.update({"q_a_proj.weight": (qr, hid), "q_a_layernorm.weight": (qr,),
                       "q_b_proj.weight": (H * (dn + dr), qr)})
    else:
        shapes["q_proj.weight"] = (H * (dn + dr), hid)
    shapes.update({"kv_a_proj_with_mqa.weight": (kvr + dr, hid), "kv_a_layernorm.weight": (kvr,),
                   "kv_b_proj.weight": (H * (dn + dv), kvr), "o_proj.weight": (hid, H * dv)})
    return shapes


def hf_layer_shapes(cfg):
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    shapes = {"self_attn." + k: v for k, v in hf_attention_shapes(cfg).items()}
    shapes.update({"input_layernorm.weight": (hid,), "post_attention_layernorm.weight": (hid,),
                   "mlp.gate_proj.weight": (inter, hid), "mlp.up_proj.weight": (inter, hid),
                   "mlp.down_proj.weight": (hid, inter)})
    return shapes


def random_weights(shapes, prefix="", seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in shapes.items():
        if len(shape) == 1:  # norms near 1
            sd[prefix + k] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=F64)
        else:
            sd[prefix + k] = torch.randn(shape, generator=g, dtype=F64) / math.sqrt(shape[1])
    return sd


def block_fp8(w):
    """DeepSeek-V3's FP8 weight format: E4M3 codes and an fp32 scale (amax / 448) per 128 x 128 block."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            s = torch.tensor(float(blk.abs().max()) / 448.0, dtype=torch.float32)
            scale[i, j] = s
            codes[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = (blk / s.double()).to(torch.float8_e4m3fn)
    return codes, scale


def dequantized(codes, scale):
    """What DeepSeek's weight_dequant computes: each block's codes times its scale in fp32."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = codes[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].to(torch.float32)
            out[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = blk * scale[i, j]
    return out


def to_fp8_checkpoint(sd, scale_suffix="_scale_inv"):
    """Every 2-D weight as FP8 codes + scales (Hugging Face: '<key>_scale_inv'); the same weights'
    dequantized values (float64) for the reference."""
    ck, ref = {}, {}
    for k, w in sd.items():
        if w.dim() == 2:
            codes, scale = block_fp8(w)
            ck[k] = codes
            ck[k + scale_suffix if scale_suffix == "_scale_inv" else k[:-len(".weight")] + ".scale"] = scale
            ref[k] = dequantized(codes, scale).double()
        else:
            ck[k] = w.float()
            ref[k] = w.float().double()
    return ck, ref


def _mla(cfg, **kw):
    return mnn.MLA(**mnn.config_kwargs(cfg), dtype=F64, max_seq_len=64, **kw)


def _block(cfg, **kw):
    return mnn.Block(**mnn.config_kwargs(cfg, "Block"), dtype=F64, max_seq_len=64, **kw)


def _x(cfg, seed=1):
    return torch.randn(2, SEQ, cfg["hidden_size"], generator=torch.Generator().manual_seed(seed), dtype=F64)


def _rel(a, b):
    return float((a.detach() - b).norm() / b.norm())


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mla_from_hf_checkpoint_computes_hf_attention(name):
    cfg = CONFIGS[name]
    p = "model.layers.0.self_attn."
    sd = random_weights(hf_attention_shapes(cfg), p)
    sd["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)  # outside the prefix: not the module's
    m = _mla(cfg, seed=123)
    assert mnn.load_pretrained(m, sd, prefix="model.layers.0.self_attn") == "hf"  # the dot is added
    x = _x(cfg)
    err = _rel(m(x), hf_attention(sd, cfg, x, p))
    assert err < 1e-6, err  # mxmla's RoPE tables are fp32; the rest is float64


def test_block_from_hf_checkpoint_computes_hf_decoder_layer():
    cfg = V3_LIKE
    sd = random_weights(hf_layer_shapes(cfg), "model.layers.2.")
    m = _block(cfg, seed=5)
    assert mnn.load_pretrained(m, sd, prefix="model.layers.2.") == "hf"
    x = _x(cfg, 2)
    err = _rel(m(x), hf_layer(sd, cfg, x, "model.layers.2."))
    assert err < 1e-6, err


@pytest.mark.parametrize("scale_suffix", ["_scale_inv", ".scale"])
def test_fp8_weights_load_as_deepseeks_block_dequantization(scale_suffix):
    """DeepSeek-V3's released FP8 weights (Hugging Face: weight_scale_inv; DeepSeek's own code: scale):
    each parameter equals the fp32 product of code and block scale bit for bit, tails included."""
    cfg = V3_LIKE
    hf = random_weights(hf_attention_shapes(cfg), seed=3)
    if scale_suffix == ".scale":  # DeepSeek's inference/model.py names
        m0 = _mla(cfg)
        mnn.load_pretrained(m0, hf)
        plain = mnn.pretrained_state_dict(m0, "deepseek", dtype=F64)
        ck, ref = to_fp8_checkpoint(plain, ".scale")
    else:
        ck, ref = to_fp8_checkpoint(hf)
    m = mnn.MLA(**mnn.config_kwargs(cfg), max_seq_len=64)  # fp32 parameters, as training keeps them
    naming = mnn.load_pretrained(m, ck)
    assert naming == ("hf" if scale_suffix == "_scale_inv" else "deepseek")
    got = mnn.pretrained_state_dict(m, naming, dtype=None)
    for k, want in ref.items():
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], want.float()), k
    # and the module computes Hugging Face's attention on the dequantized weights
    m64 = _mla(cfg)
    mnn.load_pretrained(m64, ck)
    x = _x(cfg)
    ref_hf = ref if naming == "hf" else mnn.pretrained_state_dict(m64, "hf", dtype=F64)
    assert _rel(m64(x), hf_attention(ref_hf, cfg, x)) < 1e-6


@pytest.mark.parametrize("naming", ["hf", "megatron", "deepseek"])
@pytest.mark.parametrize("what", ["mla", "mla-no-q-lora", "block"])
def test_namings_round_trip(naming, what):
    cfg = V2_LITE_LIKE if what == "mla-no-q-lora" else V3_LIKE
    make = _block if what == "block" else _mla
    a, b = make(cfg, seed=1), make(cfg, seed=2)
    sd = mnn.pretrained_state_dict(a, naming, prefix="decoder.layers.3", dtype=None)
    assert all(k.startswith("decoder.layers.3.") for k in sd)
    assert mnn.load_pretrained(b, sd, prefix="decoder.layers.3.") == naming
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    x = _x(cfg)
    assert torch.equal(a(x), b(x))


def test_megatron_names_and_their_alternatives():
    """Megatron-Core: linear_fc1 = [gate; up], the norms fused into the TE layers or separate
    (q_layernorm / kv_layernorm / pre_mlp_layernorm, the local spec): the same weights."""
    cfg = V3_LIKE
    a = _block(cfg, seed=1)
    hf = mnn.pretrained_state_dict(a, "hf", dtype=None)
    mg = mnn.pretrained_state_dict(a, "megatron", dtype=None)
    assert torch.equal(mg["mlp.linear_fc1.weight"], torch.cat([hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"]]))
    assert torch.equal(mg["self_attention.linear_q_up_proj.layer_norm_weight"], hf["self_attn.q_a_layernorm.weight"])
    local = dict(mg)
    for fused, plain in (("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
                         ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
                         ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")):
        local[plain] = local.pop(fused)
    local["self_attention.core_attention._extra_state"] = torch.zeros(4, dtype=torch.uint8)  # TE's: skipped
    b = _block(cfg, seed=2)
    assert mnn.load_pretrained(b, local) == "megatron"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_load_casts_to_the_parameters_dtype_and_recipe():
    """bf16 weights into fp32 master parameters (exact); the same weights serve any recipe."""
    cfg = V3_LIKE
    sd = {k: v.to(torch.bfloat16) for k, v in random_weights(hf_attention_shapes(cfg)).items()}
    for recipe in ("bf16", "block-fp8"):
        m = mnn.MLA(**mnn.config_kwargs(cfg), recipe=recipe, max_seq_len=64)
        mnn.load_pretrained(m, sd)
        assert m.wq_b.weight.dtype == torch.float32
        assert torch.equal(m.wq_b.weight, sd["q_b_proj.weight"].float())
        assert torch.equal(mnn.pretrained_state_dict(m)["q_b_proj.weight"], sd["q_b_proj.weight"])


def test_config_kwargs_reads_config_json_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V3_LIKE))
    kw = mnn.config_kwargs(tmp_path)
    assert kw == mnn.config_kwargs(str(tmp_path / "config.json")) == mnn.config_kwargs(V3_LIKE)
    assert kw["yarn"] == dict(factor=4.0, original_max_position=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                              mscale_all_dim=1.0)
    assert mnn.config_kwargs(V2_LITE_LIKE)["q_lora_rank"] == 0
    assert mnn.config_kwargs(PLAIN_ROPE)["yarn"] is None
    assert mnn.config_kwargs(V3_LIKE, "Block")["inter_dim"] == 136
    # Hugging Face's defaults for missing YaRN keys (mscale_all_dim 0: no softmax-scale factor)
    kw = mnn.config_kwargs(dict(V3_LIKE, rope_scaling={"rope_type": "yarn", "factor": 40}))
    assert kw["yarn"] == dict(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                              mscale_all_dim=0.0)
    assert mnn.MLA(**kw, dtype=F64).softmax_scale == pytest.approx(32 ** -0.5)

    class Cfg:  # a config object with attributes (transformers' PretrainedConfig has to_dict)
        def __init__(self):
            self.__dict__.update(V3_LIKE)

    assert mnn.config_kwargs(Cfg()) == mnn.config_kwargs(V3_LIKE)


def test_bad_checkpoints_and_configs_give_clear_errors():
    cfg = V3_LIKE
    sd = random_weights(hf_attention_shapes(cfg), "a.")
    m = _mla(cfg)
    with pytest.raises(TypeError, match="module must be an mxmla.nn.MLA, SwiGLU or Block"):
        mnn.load_pretrained(torch.nn.Linear(2, 2), sd)
    with pytest.raises(ValueError, match="no weight under prefix 'b.'"):
        mnn.load_pretrained(m, sd, prefix="b")
    with pytest.raises(ValueError, match="naming must be one of"):
        mnn.load_pretrained(m, sd, prefix="a", naming="te")
    bad = dict(sd)
    del bad["a.kv_b_proj.weight"]
    with pytest.raises(ValueError, match=r"misses 'a.kv_b_proj.weight'"):
        mnn.load_pretrained(m, bad, prefix="a")
    bad = dict(sd, **{"a.o_proj.bias": torch.zeros(160)})
    with pytest.raises(ValueError, match=r"does not take .*'a.o_proj.bias'"):
        mnn.load_pretrained(m, bad, prefix="a")
    mnn.load_pretrained(m, bad, prefix="a", strict=False)
    other = mnn.MLA(**dict(mnn.config_kwargs(cfg), heads=2), dtype=F64)
    with pytest.raises(ValueError, match=r"'a.q_b_proj.weight' has shape \(96, 48\), mxmla.nn.MLA's 'wq_b.weight' "
                                         r"needs \(64, 48\)"):
        mnn.load_pretrained(other, sd, prefix="a")
    ck, _ = to_fp8_checkpoint(sd)
    no_scale = {k: v for k, v in ck.items() if k != "a.o_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match=r"'a.o_proj.weight' is torch.float8_e4m3fn and needs its block scales"):
        mnn.load_pretrained(m, no_scale, prefix="a")
    wrong = dict(ck, **{"a.o_proj.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match=r"'a.o_proj.weight_scale_inv' must be a float tensor of shape \(2, 1\)"):
        mnn.load_pretrained(m, wrong, prefix="a")
    e5 = dict(ck, **{"a.o_proj.weight": ck["a.o_proj.weight"].float().to(torch.float8_e5m2)})
    with pytest.raises(ValueError, match="'a.o_proj.weight' is float8_e5m2"):
        mnn.load_pretrained(m, e5, prefix="a")
    ints = dict(sd, **{"a.o_proj.weight": torch.zeros(160, 72, dtype=torch.int32)})
    with pytest.raises(ValueError, match="'a.o_proj.weight' must be a float tensor"):
        mnn.load_pretrained(m, ints, prefix="a")
    mg = mnn.pretrained_state_dict(_block(cfg), "megatron")
    mg["mlp.linear_fc1.weight"] = mg["mlp.linear_fc1.weight"][:-1]
    with pytest.raises(ValueError, match="'mlp.linear_fc1.weight' must have a row count divisible by 2"):
        mnn.load_pretrained(_block(cfg), mg)
    with pytest.raises(ValueError, match="rope_scaling type 'linear' is not supported"):
        mnn.config_kwargs(dict(cfg, rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="config misses kv_lora_rank"):
        mnn.config_kwargs({k: v for k, v in cfg.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="config misses intermediate_size"):
        mnn.config_kwargs({k: v for k, v in cfg.items() if k != "intermediate_size"}, "Block")
    with pytest.raises(ValueError, match="module must be 'MLA' or 'Block'"):
        mnn.config_kwargs(cfg, "Decoder")
    with pytest.raises(ValueError, match="naming must be one of"):
        mnn.pretrained_state_dict(m, "te")


def test_read_checkpoint_reads_only_the_prefix_of_a_sharded_safetensors_folder(tmp_path):
    """A Hugging Face checkpoint folder (model.safetensors.index.json and two shard files, FP8
    weights with their scales split across them): load_pretrained takes the folder's path; only the
    prefix's tensors are read, from the files that hold them."""
    st = pytest.importorskip("safetensors.torch")
    cfg = V3_LIKE
    layer0, _ = to_fp8_checkpoint(random_weights(hf_attention_shapes(cfg), "model.layers.0.self_attn.", seed=3))
    layer1 = random_weights(hf_attention_shapes(cfg), "model.layers.1.self_attn.", seed=4)
    keys0 = sorted(layer0)
    shards = {"model-00001-of-00003.safetensors": {k: layer0[k] for k in keys0[::2]},
              "model-00002-of-00003.safetensors": {k: layer0[k] for k in keys0[1::2]},
              "model-00003-of-00003.safetensors": {k: v.to(torch.bfloat16) for k, v in layer1.items()}}
    for name, part in shards.items():
        st.save_file({k: v.contiguous() for k, v in part.items()}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = mnn.read_checkpoint(tmp_path, "model.layers.0.self_attn")
    assert sorted(got) == keys0
    assert all(got[k].dtype == layer0[k].dtype and torch.equal(got[k].float(), layer0[k].float()) for k in keys0)
    # the third file is not even opened for layer 0: a broken one does not matter
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"not a safetensors file")
    a, b = _mla(cfg, seed=1), _mla(cfg, seed=2)
    mnn.load_pretrained(a, tmp_path, prefix="model.layers.0.self_attn.")
    mnn.load_pretrained(b, layer0, prefix="model.layers.0.self_attn.")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # a folder of .safetensors files without an index, and one file
    plain = tmp_path / "plain"
    plain.mkdir()
    st.save_file({k: v.contiguous() for k, v in layer1.items()}, str(plain / "model.safetensors"))
    assert sorted(mnn.read_checkpoint(plain)) == sorted(layer1)
    assert sorted(mnn.read_checkpoint(plain / "model.safetensors", "model.layers.1.self_attn.")) == sorted(layer1)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        mnn.read_checkpoint(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor .safetensors files"):
        mnn.read_checkpoint(empty)


# a Block's projections under Hugging Face's names (spelled out by hand, apart from the module's table)
HF_PROJECTIONS = {"attn.wq_a.weight": "self_attn.q_a_proj.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
                  "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
                  "attn.wkv_b.weight": "self_attn.kv_b_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
                  "ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
                  "ffn.w2.weight": "mlp.down_proj.weight"}


@pytest.mark.parametrize("naming", ["hf", "deepseek"])
def test_fp8_export_in_deepseeks_format_loads_back(naming):
    """pretrained_state_dict(fp8=True): each projection as float8_e4m3fn codes with an fp32 factor per
    128 x 128 block (Hugging Face's weight_scale_inv, DeepSeek's scale), the norms in bf16; loaded
    back, each weight is its blocks' codes times their factors in fp32, within E4M3's rounding of the
    trained weight."""
    cfg = V3_LIKE
    a = _block(cfg, seed=1)
    sd = mnn.pretrained_state_dict(a, naming, fp8=True)
    assert sorted(k for k, v in sd.items() if v.dtype == torch.float8_e4m3fn) == \
        sorted(HF_PROJECTIONS.values() if naming == "hf" else HF_PROJECTIONS)
    assert sd["input_layernorm.weight" if naming == "hf" else "attn_norm.weight"].dtype == torch.bfloat16
    b = _block(cfg, seed=2)
    assert mnn.load_pretrained(b, sd) == naming
    trained, loaded = a.state_dict(), b.state_dict()
    for key, hf_key in HF_PROJECTIONS.items():
        src = hf_key if naming == "hf" else key
        scale = sd[src + "_scale_inv" if naming == "hf" else src[:-len(".weight")] + ".scale"]
        codes = sd[src]
        assert scale.dtype == torch.float32 and scale.shape == (-(-codes.shape[0] // 128), -(-codes.shape[1] // 128))
        assert torch.equal(loaded[key], dequantized(codes, scale).double()), key
        assert _rel(loaded[key], trained[key]) < 2 ** -4, key
    with pytest.raises(ValueError, match="Megatron-Core's checkpoints keep bf16 weights"):
        mnn.pretrained_state_dict(a, "megatron", fp8=True)


def test_from_pretrained_builds_from_a_checkpoint_folder(tmp_path):
    """MLA.from_pretrained / Block.from_pretrained: config.json's dims with the caller's arguments on
    top, layer n's weights from the folder's safetensors files."""
    st = pytest.importorskip("safetensors.torch")
    cfg = V3_LIKE
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = {}
    for layer in (0, 1):
        sd.update(random_weights(hf_layer_shapes(cfg), f"model.layers.{layer}.", seed=10 + layer))
    st.save_file({k: v.float() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    m = mnn.MLA.from_pretrained(tmp_path, 1, dtype=F64, max_seq_len=64)
    assert m.heads == 3 and m.q_lora_rank == 48 and m.max_seq_len == 64
    x = _x(cfg)
    want = hf_attention({k: v.float().double() for k, v in sd.items()}, cfg, x, "model.layers.1.self_attn.")
    assert _rel(m(x), want) < 1e-6
    b = mnn.Block.from_pretrained(tmp_path, 0, dtype=F64, max_seq_len=64)
    want = hf_layer({k: v.float().double() for k, v in sd.items()}, cfg, x, "model.layers.0.")
    assert _rel(b(x), want) < 1e-6
    with pytest.raises(ValueError, match="layer must be an int >= 0"):
        mnn.MLA.from_pretrained(tmp_path, -1)
    with pytest.raises(ValueError, match="no weight under prefix 'model.layers.7.self_attn.'"):
        mnn.MLA.from_pretrained(tmp_path, 7, max_seq_len=64)


# DeepSeek-V3's head dims (the CUDA attention kernels' shapes), small projections
V3_HEADS = dict(V3_LIKE, hidden_size=256, num_attention_heads=2, q_lora_rank=64, kv_lora_rank=64,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8", "bf16"])
def test_cuda_mla_from_an_fp8_checkpoint_tracks_hf_attention(recipe):
    """An FP8 Hugging Face checkpoint loaded into a CUDA MLA under each recipe (the fused query path,
    MXFP8 or bf16 attention, the recipe's GEMMs). "bf16": against the float64 transcription of
    Hugging Face's attention on the dequantized weights, relative RMS < 2 % (measured 0.6 % on the
    CPU path); the FP8 recipes, whose own rounding is 9-10 % here (the CPU path against the
    transcription, 2026-12-04): against the same recipe's CPU path (the same MXFP8 / block-FP8 math
    in float64), < 3 % as test_nn_gpu's block test bounds it. The module's FP8 export on the GPU
    equals the CPU module's bit for bit (mxmla's block quantizer, kernel against reference)."""
    cfg = V3_HEADS
    ck, ref = to_fp8_checkpoint(random_weights(hf_attention_shapes(cfg), seed=8))
    m = mnn.MLA(**mnn.config_kwargs(cfg), recipe=recipe, max_seq_len=64, device="cuda")
    cpu = mnn.MLA(**mnn.config_kwargs(cfg), recipe=recipe, max_seq_len=64)
    for mod in (m, cpu):
        mnn.load_pretrained(mod, ck)
    x = _x(cfg, 3)[:, :32].to(torch.bfloat16)
    out = m(x.cuda()).double().cpu()
    if recipe == "bf16":
        want, bound = hf_attention(ref, cfg, x.double()), 0.02
    else:
        want, bound = cpu(x).double(), 0.03
    err = _rel(out, want)
    print(f"{recipe}: relative RMS against {'Hugging Face in float64' if recipe == 'bf16' else 'the CPU path'}: "
          f"{err:.4f}")
    assert err < bound, err
    a, b = mnn.pretrained_state_dict(m, fp8=True), mnn.pretrained_state_dict(cpu, fp8=True)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].cpu().view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k].cpu(),
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k
