"""Pretrained weights in and out of mxmla.nn: DeepSeek-V2 / V3 checkpoints (Hugging Face's names,
FP8 weights with their 128 x 128 block scales), Megatron-Core's MLA and DeepSeek's inference code.

- ``config_kwargs(config, module="MLA")``: the keyword arguments of ``MLA`` (or ``Block``) from a
  Hugging Face DeepSeek-V2 / V3 ``config.json`` (a dict, a path to the file or to its folder, or a
  config object): dims, ``q_lora_rank`` (null -> 0), RoPE base, YaRN, RMSNorm eps.
- ``load_pretrained(module, state_dict, prefix="")``: loads the weights of one ``MLA``, ``SwiGLU``
  or ``Block`` from a state dict in any of the three namings (detected from the keys, or `naming=`):

  mxmla's names (DeepSeek's inference/model.py) -> Hugging Face's -> Megatron-Core's:
    wq_a -> q_a_proj -> linear_q_down_proj; q_norm -> q_a_layernorm ->
      linear_q_up_proj.layer_norm_weight (or q_layernorm); wq_b -> q_b_proj -> linear_q_up_proj;
      wq -> q_proj -> linear_q_proj (q_lora_rank 0);
    wkv_a -> kv_a_proj_with_mqa -> linear_kv_down_proj; kv_norm -> kv_a_layernorm ->
      linear_kv_up_proj.layer_norm_weight (or kv_layernorm); wkv_b -> kv_b_proj -> linear_kv_up_proj;
      wo -> o_proj -> linear_proj;
    w1 / w3 / w2 -> gate_proj / up_proj / down_proj -> linear_fc1 (= [w1; w3]) / linear_fc2;
    Block: attn_norm / attn / ffn_norm / ffn -> input_layernorm / self_attn /
      post_attention_layernorm / mlp -> input_layernorm / self_attention /
      mlp.linear_fc1.layer_norm_weight (or pre_mlp_layernorm) / mlp.

  FP8 weights (float8_e4m3fn, DeepSeek-V3's released checkpoints) come with their scale —
  ``<name>.weight_scale_inv`` (Hugging Face) or ``<name>.scale`` (DeepSeek's code), fp32
  [ceil(out / 128), ceil(in / 128)] — and load as code · scale of their 128 x 128 block, computed
  in fp32 as DeepSeek's ``weight_dequant`` does, then cast to the parameters' dtype. The weights are
  the whole (tp size 1) tensors: a tensor-parallel module keeps its rank's shards.
- ``read_checkpoint(path, prefix)``: the tensors under a prefix of a safetensors checkpoint (a
  sharded Hugging Face folder: only the files and tensors needed); ``load_pretrained`` takes the
  path itself too.
- ``MLA.from_pretrained(path, layer, **kwargs)`` / ``Block.from_pretrained``: a module built from a
  Hugging Face checkpoint folder's config.json and loaded with its layer's weights.
- ``pretrained_state_dict(module, naming="hf")``: the module's whole weights (the ranks' shards
  gathered) under those names, e.g. to hand a trained block back to Hugging Face or Megatron.

The namings agree on the computation (DeepSeek's RoPE pairs (x[2i], x[2i+1]); Hugging Face's model
permutes q_pe and k_pe alike before its rotate-half RoPE, which leaves the scores unchanged), so a
module loaded from any of them computes what the checkpoint's own model computes.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .decoder import Block
from .layers import SwiGLU
from .mla import MLA
from .tp import _shards, load_unsharded_state_dict, unsharded_state_dict

NAMINGS = ("hf", "megatron", "deepseek")
_WHAT = "mxmla.nn.load_pretrained"
_BLOCK = 128  # DeepSeek-V3's FP8 weights: one fp32 scale per 128 x 128 block

# A source is (key, part): part None takes the whole tensor, (i, n) its i-th of n equal row chunks
# (Megatron's linear_fc1 holds [w1; w3]). Each mxmla key lists its sources per naming, first choice
# first (the first is what pretrained_state_dict writes).
Source = Tuple[str, Optional[Tuple[int, int]]]

_MLA_Q_LORA = {
    "wq_a.weight": {"hf": ["q_a_proj.weight"], "megatron": ["linear_q_down_proj.weight"]},
    "q_norm.weight": {"hf": ["q_a_layernorm.weight"],
                      "megatron": ["linear_q_up_proj.layer_norm_weight", "q_layernorm.weight"]},
    "wq_b.weight": {"hf": ["q_b_proj.weight"], "megatron": ["linear_q_up_proj.weight"]},
}
_MLA_Q = {"wq.weight": {"hf": ["q_proj.weight"], "megatron": ["linear_q_proj.weight"]}}
_MLA_KV = {
    "wkv_a.weight": {"hf": ["kv_a_proj_with_mqa.weight"], "megatron": ["linear_kv_down_proj.weight"]},
    "kv_norm.weight": {"hf": ["kv_a_layernorm.weight"],
                       "megatron": ["linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight"]},
    "wkv_b.weight": {"hf": ["kv_b_proj.weight"], "megatron": ["linear_kv_up_proj.weight"]},
    "wo.weight": {"hf": ["o_proj.weight"], "megatron": ["linear_proj.weight"]},
}
_MLP = {
    "w1.weight": {"hf": ["gate_proj.weight"], "megatron": [("linear_fc1.weight", (0, 2))]},
    "w3.weight": {"hf": ["up_proj.weight"], "megatron": [("linear_fc1.weight", (1, 2))]},
    "w2.weight": {"hf": ["down_proj.weight"], "megatron": ["linear_fc2.weight"]},
}
_BLOCK_NORMS = {
    "attn_norm.weight": {"hf": ["input_layernorm.weight"], "megatron": ["input_layernorm.weight"]},
    "ffn_norm.weight": {"hf": ["post_attention_layernorm.weight"],
                        "megatron": ["mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"]},
}
_BLOCK_CHILDREN = {"attn": {"hf": "self_attn.", "megatron": "self_attention."},
                   "ffn": {"hf": "mlp.", "megatron": "mlp."}}
# keys a checkpoint may hold that carry no weight of these modules
_IGNORED_SUFFIXES = ("_extra_state", "rotary_emb.inv_freq")


def _table(module: nn.Module) -> Dict[str, Dict[str, List[Source]]]:
    """mxmla state-dict key -> naming -> candidate sources, for an MLA, SwiGLU or Block."""
    if isinstance(module, MLA):
        table = dict(_MLA_Q if module.q_lora_rank == 0 else _MLA_Q_LORA, **_MLA_KV)
    elif isinstance(module, SwiGLU):
        table = dict(_MLP)
    elif isinstance(module, Block):
        table = dict(_BLOCK_NORMS)
        for child, prefixes in _BLOCK_CHILDREN.items():
            for key, names in _table(getattr(module, child)).items():
                table[f"{child}.{key}"] = {n: [_prefixed(prefixes[n], s) for s in srcs] for n, srcs in names.items()
                                           if n != "deepseek"}
    else:
        raise TypeError(f"{_WHAT}: module must be an mxmla.nn.MLA, SwiGLU or Block, got {type(module).__name__}")
    out = {}
    for key, names in table.items():
        full = {n: [s if isinstance(s, tuple) else (s, None) for s in srcs] for n, srcs in names.items()}
        full["deepseek"] = [(key, None)]  # mxmla's own names are DeepSeek's inference/model.py names
        out[key] = full
    return out


def _prefixed(prefix: str, src: Union[str, Source]) -> Source:
    return (prefix + src[0], src[1]) if isinstance(src, tuple) else (prefix + src, None)


def _scale_keys(key: str, naming: str) -> List[str]:
    """Where an FP8 weight's block scales may be: Hugging Face's weight_scale_inv, DeepSeek's scale."""
    base = key[:-len(".weight")] if key.endswith(".weight") else key
    return [key + "_scale_inv", base + ".scale"] if naming != "megatron" else [key + "_scale_inv"]


def _module_name(module: nn.Module) -> str:
    return f"mxmla.nn.{type(module).__name__}"


def _whole_shapes(module: nn.Module) -> Dict[str, torch.Size]:
    """Each state-dict entry's shape at tp size 1 (a sharded weight's split dim times the tp size)."""
    shapes = {k: v.shape for k, v in module.state_dict().items()}
    for key, dim, owner, _ in _shards(module):
        s = list(shapes[key])
        s[dim] *= owner.tp_size
        shapes[key] = torch.Size(s)
    return shapes


def _dequantize_fp8(what: str, key: str, w: torch.Tensor, scale: torch.Tensor, scale_key: str) -> torch.Tensor:
    """An E4M3 weight [out, in] times its block's fp32 scale [ceil(out/128), ceil(in/128)]: mxmla's
    BlockFP8Tensor.dequantize (code · scale rounded once to fp32, as DeepSeek's weight_dequant)."""
    from ..blockfp8 import BlockFP8Tensor

    if w.dim() != 2:
        raise ValueError(f"{what}: FP8 weight '{key}' must be 2-D [out, in], got shape {tuple(w.shape)}")
    want = (-(-w.shape[0] // _BLOCK), -(-w.shape[1] // _BLOCK))
    if tuple(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(f"{what}: '{scale_key}' must be a float tensor of shape {want} (one scale per 128 x 128 "
                         f"block of '{key}' {tuple(w.shape)}), got {scale.dtype} of shape {tuple(scale.shape)}")
    return BlockFP8Tensor(w, scale.to(device=w.device, dtype=torch.float32), _BLOCK).dequantize()


def _detect(what: str, sd: Dict[str, Any], table, prefix: str) -> str:
    counts = {n: sum(any(prefix + k in sd for k, _ in names[n]) for names in table.values()) for n in NAMINGS}
    best = max(counts.values())
    if best == 0:
        firsts = {n: [names[n][0][0] for names in table.values()][:3] for n in NAMINGS}
        raise ValueError(f"{what}: no weight under prefix {prefix!r} in any naming (Hugging Face: "
                         f"{firsts['hf']}..., Megatron-Core: {firsts['megatron']}..., DeepSeek / mxmla: "
                         f"{firsts['deepseek']}...); give the prefix of the module's keys, e.g. "
                         f"'model.layers.0.self_attn.'")
    winners = [n for n in NAMINGS if counts[n] == best]
    if len(winners) > 1:
        raise ValueError(f"{what}: the keys under prefix {prefix!r} fit the namings {winners} equally; "
                         f"say which with naming=")
    return winners[0]


def _dotted(prefix: str, what: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"{what}: prefix must be a str, got {type(prefix).__name__}")
    return prefix + "." if prefix and not prefix.endswith(".") else prefix


def read_checkpoint(path: Union[str, "os.PathLike[str]"], prefix: str = "") -> Dict[str, torch.Tensor]:
    """The tensors under `prefix` of a safetensors checkpoint, on the CPU: `path` is a folder with
    Hugging Face's model.safetensors.index.json (only the files that hold those keys are opened, and
    only those tensors read: one layer of DeepSeek-V3's 163 files costs its own bytes), a folder of
    .safetensors files, or one file. Needs the safetensors package."""
    what = "mxmla.nn.read_checkpoint"
    prefix = _dotted(prefix, what)
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - exercised only without safetensors
        raise ImportError(f"{what} reads .safetensors files and needs the safetensors package "
                          f"(pip install safetensors)") from e
    path = os.fspath(path)
    files: Dict[str, Optional[List[str]]]
    if os.path.isdir(path):
        base, index = path, os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {}
            for key, name in weight_map.items():
                if key.startswith(prefix):
                    files.setdefault(name, []).append(key)
        else:
            files = {name: None for name in sorted(os.listdir(path)) if name.endswith(".safetensors")}
            if not files:
                raise FileNotFoundError(f"{what}: {path!r} holds neither model.safetensors.index.json nor "
                                        f".safetensors files")
    elif os.path.isfile(path):
        base, files = os.path.dirname(path), {os.path.basename(path): None}
    else:
        raise FileNotFoundError(f"{what}: no such file or folder: {path!r}")
    out = {}
    for name, keys in files.items():
        with safe_open(os.path.join(base, name), framework="pt", device="cpu") as f:
            for key in keys if keys is not None else [k for k in f.keys() if k.startswith(prefix)]:
                out[key] = f.get_tensor(key)
    return out


def load_pretrained(module: nn.Module, state_dict: Union[Dict[str, Any], str, "os.PathLike[str]"], prefix: str = "",
                    naming: Optional[str] = None, strict: bool = True) -> str:
    """Loads `module`'s weights (an mxmla.nn.MLA, SwiGLU or Block) from `state_dict`'s keys under
    `prefix` (e.g. "model.layers.0.self_attn." for a Hugging Face checkpoint's first attention,
    "model.layers.0." for its whole first layer as a Block; a dot is added if missing).
    state_dict: a dict of tensors, or a safetensors checkpoint's path (read_checkpoint). naming:
    "hf", "megatron" or "deepseek" (mxmla's own names), or None to detect it from the keys. Weights
    are the whole (tp size 1) tensors in any float dtype, or float8_e4m3fn with their 128 x 128
    block scales; they are checked against the module's dims and cast to its parameters' dtype.
    strict: a key under the prefix that the module does not take is an error (a MoE layer's experts,
    a bias; TransformerEngine's `_extra_state` and rotary `inv_freq` buffers are skipped). Returns
    the naming used."""
    what = _WHAT
    prefix = _dotted(prefix, what)
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = read_checkpoint(state_dict, prefix)
    if not isinstance(state_dict, dict):
        raise TypeError(f"{what}: state_dict must be a dict of tensors or a checkpoint's path, "
                        f"got {type(state_dict).__name__}")
    table = _table(module)
    if naming is None:
        naming = _detect(what, state_dict, table, prefix)
    elif naming not in NAMINGS:
        raise ValueError(f"{what}: naming must be one of {', '.join(map(repr, NAMINGS))} or None, got {naming!r}")
    shapes = _whole_shapes(module)
    used, missing, whole = set(), [], {}
    for key, names in table.items():
        found = [(k, part) for k, part in names[naming] if prefix + k in state_dict]
        if not found:
            missing.append(" or ".join(repr(prefix + k) for k, _ in names[naming]))
            continue
        src, part = found[0]
        src_key = prefix + src
        w = state_dict[src_key]
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{what}: '{src_key}' must be a tensor, got {type(w).__name__}")
        used.add(src_key)
        if w.dtype == torch.float8_e5m2:
            raise ValueError(f"{what}: '{src_key}' is float8_e5m2; FP8 checkpoints with block scales (DeepSeek-V3's) "
                             f"hold float8_e4m3fn codes")
        if w.dtype == torch.float8_e4m3fn:
            scale_key = next((prefix + s for s in _scale_keys(src, naming) if prefix + s in state_dict), None)
            if scale_key is None:
                raise ValueError(f"{what}: '{src_key}' is {w.dtype} and needs its block scales: none of "
                                 f"{[prefix + s for s in _scale_keys(src, naming)]} is in the state dict")
            used.add(scale_key)
            w = _dequantize_fp8(what, src_key, w, state_dict[scale_key], scale_key)
        elif not w.is_floating_point():
            raise ValueError(f"{what}: '{src_key}' must be a float tensor (or FP8 with its scales), got {w.dtype}")
        if part is not None:
            i, n = part
            if w.dim() == 0 or w.shape[0] % n:
                raise ValueError(f"{what}: '{src_key}' must have a row count divisible by {n} (it holds "
                                 f"{n} weights stacked), got shape {tuple(w.shape)}")
            w = w.chunk(n, dim=0)[i]
        if w.shape != shapes[key]:
            detail = f" (rows {part[0]} of {part[1]} of it)" if part is not None else ""
            raise ValueError(f"{what}: '{src_key}'{detail} has shape {tuple(w.shape)}, {_module_name(module)}'s "
                             f"'{key}' needs {tuple(shapes[key])}: the module's dims differ from the checkpoint's")
        whole[key] = w
    if missing:
        raise ValueError(f"{what}: {_module_name(module)} ({naming} naming, prefix {prefix!r}) misses "
                         f"{', '.join(missing)}")
    if strict:
        extra = sorted(k for k in state_dict if k.startswith(prefix) and k not in used
                       and not k.endswith(_IGNORED_SUFFIXES))
        if extra:
            raise ValueError(f"{what}: keys under prefix {prefix!r} that {_module_name(module)} does not take "
                             f"({naming} naming): {extra[:8]}{' ...' if len(extra) > 8 else ''} (strict=False "
                             f"skips them)")
    params = module.state_dict()
    with torch.no_grad():
        load_unsharded_state_dict(module, {k: w.to(device=params[k].device, dtype=params[k].dtype)
                                           for k, w in whole.items()})
    return naming


def pretrained_state_dict(module: nn.Module, naming: str = "hf", prefix: str = "",
                          dtype: Optional[torch.dtype] = torch.bfloat16, fp8: bool = False) -> Dict[str, torch.Tensor]:
    """`module`'s whole weights (an MLA, SwiGLU or Block; a tensor-parallel one's shards gathered,
    the same on every rank) under `naming`'s keys ("hf", "megatron", "deepseek"), each key prefixed
    with `prefix`, in `dtype` (None: the parameters' dtype). Megatron's names are those of its
    TransformerEngine layers (the norms fused into linear_q_up_proj, linear_kv_up_proj and
    linear_fc1; linear_fc1 = [w1; w3]). fp8: the projections' weights in DeepSeek-V3's released
    format instead — float8_e4m3fn codes with one fp32 factor per 128 x 128 block (mxmla's
    quantize_blockwise, scale = 448 / amax not rounded to a power of two, as DeepSeek's are not),
    stored as `<name>.weight_scale_inv` ("hf") or `<name>.scale` ("deepseek"); the norms in
    `dtype`. load_pretrained reads either back."""
    what = "mxmla.nn.pretrained_state_dict"
    if naming not in NAMINGS:
        raise ValueError(f"{what}: naming must be one of {', '.join(map(repr, NAMINGS))}, got {naming!r}")
    if not isinstance(fp8, bool):
        raise TypeError(f"{what}: fp8 must be a bool, got {type(fp8).__name__}")
    if fp8 and naming == "megatron":
        raise ValueError(f"{what}: fp8=True writes DeepSeek-V3's FP8 weights with their block scales, which the "
                         f"'hf' and 'deepseek' namings hold; Megatron-Core's checkpoints keep bf16 weights")
    prefix = _dotted(prefix, what)
    table = _table(module)
    whole = unsharded_state_dict(module)
    out: Dict[str, torch.Tensor] = {}
    stacked: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
    for key, names in table.items():
        src, part = names[naming][0]
        if fp8 and whole[key].dim() == 2:  # a projection (part is None: not Megatron's stacked fc1)
            from ..blockfp8 import quantize_blockwise

            q = quantize_blockwise(whole[key].to(torch.float32).contiguous(), block_rows=128, pow2_scales=False)
            out[prefix + src] = q.data
            out[prefix + (src + "_scale_inv" if naming == "hf" else src[:-len(".weight")] + ".scale")] = q.scale_inv
            continue
        w = whole[key] if dtype is None else whole[key].to(dtype)
        if part is None:
            out[prefix + src] = w
        else:
            stacked.setdefault(prefix + src, []).append((part[0], w))
    for k, parts in stacked.items():
        out[k] = torch.cat([w for _, w in sorted(parts, key=lambda p: p[0])], dim=0)
    return out


def from_pretrained(cls: type, path: Union[str, "os.PathLike[str]"], layer: int, prefix: Optional[str] = None,
                    **kwargs: Any) -> nn.Module:
    """An mxmla.nn.MLA or Block (cls) for layer `layer` of the Hugging Face checkpoint folder `path`:
    dims, RoPE and norms from its config.json (config_kwargs; `kwargs` add to them or override them:
    recipe, max_seq_len, dtype, tp_group, ...), weights from its safetensors files under `prefix`
    (default "model.layers.{layer}.self_attn." for MLA, "model.layers.{layer}." for Block; only
    those tensors are read). ``MLA.from_pretrained`` and ``Block.from_pretrained`` call this."""
    what = f"mxmla.nn.{getattr(cls, '__name__', cls)}.from_pretrained"
    if cls not in (MLA, Block):
        raise TypeError(f"{what}: builds an mxmla.nn.MLA or Block, got {cls!r}")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"{what}: layer must be an int >= 0, got {layer!r}")
    kw = config_kwargs(path, cls.__name__)
    kw.update(kwargs)
    module = cls(**kw)
    if prefix is None:
        prefix = f"model.layers.{layer}.self_attn." if cls is MLA else f"model.layers.{layer}."
    load_pretrained(module, path, prefix=prefix)
    return module


def _config_dict(what: str, config: Any) -> Dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return config.to_dict()
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    raise TypeError(f"{what}: config must be a dict, a path to config.json (or its folder) or a config object, "
                    f"got {type(config).__name__}")


def _yarn_from(what: str, scaling: Any) -> Optional[Dict[str, float]]:
    """Hugging Face's rope_scaling (DeepSeek's YaRN) as mxmla's yarn dict; the defaults are Hugging
    Face's DeepseekV3YarnRotaryEmbedding's (mscale_all_dim 0: no softmax-scale factor)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"{what}: config's rope_scaling must be a dict or null, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"{what}: config's rope_scaling type {kind!r} is not supported (mxmla's RoPE tables "
                         f"know plain RoPE and DeepSeek's YaRN, type 'yarn')")
    if "factor" not in scaling:
        raise ValueError(f"{what}: config's rope_scaling (yarn) needs 'factor'")
    defaults = dict(original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=0.0)
    get = lambda k: defaults[k] if scaling.get(k) is None else scaling[k]  # noqa: E731
    return dict(factor=float(scaling["factor"]), original_max_position=int(get("original_max_position_embeddings")),
                beta_fast=float(get("beta_fast")), beta_slow=float(get("beta_slow")), mscale=float(get("mscale")),
                mscale_all_dim=float(get("mscale_all_dim")))


def config_kwargs(config: Any, module: str = "MLA") -> Dict[str, Any]:
    """Keyword arguments of mxmla.nn.MLA (module="MLA") or Block ("Block": inter_dim added, the dense
    MLP's intermediate_size) from a Hugging Face DeepSeek-V2 / V3 config: a dict, a path to its
    config.json (or the folder holding it) or a config object. Read: hidden_size,
    num_attention_heads, q_lora_rank (null: 0), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim, rope_theta (10000), rms_norm_eps (1e-6), rope_scaling (YaRN, with Hugging Face's
    defaults for missing keys). The recipe, max_seq_len, dtype and the rest stay the caller's:
    MLA(**config_kwargs(cfg), recipe="mxfp8", max_seq_len=4096)."""
    what = "mxmla.nn.config_kwargs"
    if module not in ("MLA", "Block"):
        raise ValueError(f"{what}: module must be 'MLA' or 'Block', got {module!r}")
    c = _config_dict(what, config)
    need = ["hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim"] + (["intermediate_size"] if module == "Block" else [])
    absent = [k for k in need if c.get(k) is None]
    if absent:
        raise ValueError(f"{what}: config misses {', '.join(absent)} (a DeepSeek-V2 / V3 config.json has them)")
    kw = dict(hidden=int(c["hidden_size"]), heads=int(c["num_attention_heads"]),
              q_lora_rank=int(c.get("q_lora_rank") or 0), kv_lora_rank=int(c["kv_lora_rank"]),
              nope_dim=int(c["qk_nope_head_dim"]), rope_dim=int(c["qk_rope_head_dim"]), v_dim=int(c["v_head_dim"]),
              yarn=_yarn_from(what, c.get("rope_scaling")), rope_base=float(c.get("rope_theta") or 10000.0),
              norm_eps=float(c.get("rms_norm_eps") or 1e-6))
    if module == "Block":
        kw["inter_dim"] = int(c["intermediate_size"])
    return kw


__all__: Sequence[str] = ["NAMINGS", "config_kwargs", "from_pretrained", "load_pretrained", "pretrained_state_dict",
                          "read_checkpoint"]
