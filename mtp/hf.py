"""Hugging Face checkpoints in and out: our tensor names and config fields against theirs, and the
files (config.json, safetensors shards, their index) written so that a crash never leaves half a
file. A learner can skip this file: model.py is the model, and this is only its file format.

Llama-3.x, Qwen3 and Qwen2 folders load with `from_pretrained` and save with `save_pretrained`;
transformers (and vLLM) read what we save. Names and shapes are checked before any weight is
copied, so a bad folder fails with one clear error instead of giving a wrong model.
"""

import functools
import json
import os
import re
from pathlib import Path

import torch

from model import ModelConfig, Transformer, rope_inv_freq

# each of model.MODEL_TYPES -> the architecture config.json names
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2": "Qwen2ForCausalLM"}

# our module name -> theirs
HF_NAMES = {
    "tok_emb": "model.embed_tokens",
    "norm": "model.norm",
    "lm_head": "lm_head",
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    # attn.wq: self_attn.q_proj, ...
    **{f"attn.w{x}": f"self_attn.{x}_proj" for x in "qkvo"},
    # the q/k norms of Qwen3
    **{f"attn.{x}_norm": f"self_attn.{x}_norm" for x in "qk"},
    **{f"mlp.{x}": f"mlp.{x}_proj" for x in ("gate", "up", "down")},
}


def hf_names(model: Transformer) -> dict:
    """{Hugging Face name: our name} of each tensor in a checkpoint (a tied lm_head
    is not one)."""
    # adapter.py imports this module: imported here, there is no cycle
    from adapter import is_adapter_tensor

    names = {}
    for name in model.state_dict():
        # a gated mask adapter saves on its own
        if is_adapter_tensor(name):
            continue
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue
        match = re.fullmatch(r"(layers\.\d+\.)?(.+)\.(weight|bias)", name)
        layer, module, suffix = match.groups()
        prefix = f"model.{layer}" if layer else ""
        names[f"{prefix}{HF_NAMES[module]}.{suffix}"] = name
    return names


def from_pretrained(path, device="cpu", dtype=torch.float32) -> Transformer:
    """The model saved in folder `path` (eval mode); names and shapes are checked
    first: a bad file fails loudly."""
    cfg = read_model_config(path)
    tensors = read_safetensors(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    names = hf_names(model)
    shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        # some exports write the tied copy anyway
        tensors.pop("lm_head.weight", None)

    # Every problem in one message, three names of each kind at most.
    wrong = []
    for h in sorted(set(names) & set(tensors)):
        shape = list(tensors[h].shape)
        if shape != shapes[names[h]]:
            wrong.append(f"{h} {shape} (expected {shapes[names[h]]})")
    missing = sorted(set(names) - set(tensors))
    unexpected = sorted(set(tensors) - set(names))
    problems = []
    for what, bad in (("missing", missing), ("unexpected", unexpected)):
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            problems.append(f"{what} {', '.join(bad[:3])}{more}")
    if wrong:
        problems.append(f"wrong shape {', '.join(wrong[:3])}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: "
                         + "; ".join(problems))

    # one tensor at a time: the file's copy is freed as ours is made
    ours = {names[h]: tensors.pop(h).to(device=device, dtype=dtype) for h in list(tensors)}
    # tied: lm_head is set next
    model.load_state_dict(ours, assign=True, strict=not cfg.tie_embeddings)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def save_pretrained(model: Transformer, path, max_shard_bytes: int = 5 * 2**30, dtype=None):
    """Write the model into folder `path` in Hugging Face layout (in `dtype`, default
    its own): one model.safetensors, or shards of at most max_shard_bytes and their
    index, and config.json. A gated mask adapter is not saved (adapter.py saves it)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    sd = model.state_dict()
    state = {h: sd[n].detach().to(dtype or sd[n].dtype).contiguous().cpu()
             for h, n in hf_names(model).items()}
    shards = [{}]
    size = 0
    for name, t in state.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    # leftovers of an earlier, differently sharded save
    for stale in os.listdir(path):
        if stale.startswith("model") and stale.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, stale))

    n = len(shards)
    files = ["model.safetensors"]
    if n > 1:
        files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file, shard in zip(files, shards):
        write = functools.partial(save_file, shard, metadata={"format": "pt"})
        atomic_save(write, os.path.join(path, file))
    if n > 1:
        total = sum(t.nbytes for t in state.values())
        weight_map = {name: file for file, shard in zip(files, shards) for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(os.path.join(path, "model.safetensors.index.json"), index)
    saved_dtype = next(iter(state.values())).dtype
    write_json(os.path.join(path, "config.json"), config_to_hf(model.config, saved_dtype))


def config_from_hf(hf: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                         f"supported: {', '.join(HF_ARCHITECTURES)}")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=true")

    # New transformers: rope_parameters {rope_theta, rope_type, ...}; old:
    # rope_theta and rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope = rope or dict(hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}

    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attn_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        model_type=model_type,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        mask_token_id=hf.get("mask_token_id"),
    )


def config_to_hf(cfg: ModelConfig, dtype=torch.float32) -> dict:
    """The config.json of `cfg`, in the old style that old and new transformers (and
    vLLM) read."""
    hf = {
        "architectures": [HF_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    }
    # Qwen2 always has attention biases, and no field for them
    if cfg.model_type != "qwen2":
        hf["attention_bias"] = cfg.attn_bias
    return {
        **hf,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "mask_token_id": cfg.mask_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def read_json(path, what="file") -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        # utf-8-sig: a byte-order mark (Notepad writes one) is no error
        with open(path, encoding="utf-8-sig") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, found a {type(obj).__name__}")
    return obj


def read_model_config(path) -> ModelConfig:
    file = os.path.join(path, "config.json")
    hf = read_json(file, "model config")
    try:
        return config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        problem = str(e).replace(" in config.json", "")
        if isinstance(e, KeyError):
            problem = f"missing field {e}"
        raise ValueError(f"{file}: {problem}") from None


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2) + "\n")


def write_text(path, text):
    """`text` into the file `path` (UTF-8), by atomic_save."""
    atomic_save(lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), path)


def atomic_save(write, path):
    """Call write(tmp_path), then rename over `path`: a crash never leaves a
    half-written file. The file gets the mode open() gives (safetensors writes its
    files for the owner only)."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def safetensors_files(path) -> list[str]:
    """The safetensors files of a single-file or sharded checkpoint folder."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if not os.path.isfile(index):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json "
                                f"in {path}")
    weight_map = read_json(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"missing checkpoint shard {f}")
    return files


def read_safetensors(path) -> dict:
    """All tensors of a single-file or sharded safetensors checkpoint (never
    unpickles)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    tensors = {}
    for f in safetensors_files(path):
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"cannot read {f} (truncated or corrupt safetensors "
                             f"file): {e}") from None
    return tensors
