"""mtp/hf.py: Hugging Face checkpoints in and out, on tiny random checkpoints the
tests write with transformers (nothing is downloaded).

A folder we export, with <mask> added, loads in transformers with the same logits; both
config.json styles read the same; a bad folder is one clear error, never a wrong model.
"""
import json
import os

import pytest
import torch

from model import MODEL_TYPES, ModelConfig, Transformer, add_mask_token
from mtp.hf import (HF_ARCHITECTURES, config_from_hf, from_pretrained, read_model_config,
                    save_pretrained, write_json)
from test_model import LLAMA3, QWEN3, hf_model


def test_every_model_type_has_a_hugging_face_architecture():
    assert tuple(HF_ARCHITECTURES) == MODEL_TYPES
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        ModelConfig(model_type="gpt2")


def test_older_and_newer_config_styles_agree():
    old = dict(LLAMA3, torch_dtype="bfloat16")
    new = {k: v for k, v in LLAMA3.items()
           if k not in ("rope_theta", "rope_scaling")}
    new.update(dtype="bfloat16",
               rope_parameters={**LLAMA3["rope_scaling"], "rope_theta": 500000.0})
    assert config_from_hf(old) == config_from_hf(new)
    assert config_from_hf(old).rope_scaling["factor"] == 8.0

@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_saved_model_loads_back_the_same(tmp_path, model_type):
    """Without transformers: our own save and load give the same model and config."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=64, model_type=model_type, qk_norm=model_type == "qwen3",
                      attn_bias=model_type == "qwen2", tie_embeddings=model_type == "qwen3",
                      mask_token_id=49)
    model = Transformer(cfg).eval()
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    again = from_pretrained(tmp_path)
    assert read_model_config(tmp_path) == again.config == cfg
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))


def test_write_json_replaces_the_file_whole(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("an older, longer file " * 10)
    write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert os.listdir(tmp_path) == ["x.json"]


class _Vocab:
    """The bit of the tokenizer interface add_mask_token uses."""

    def __init__(self, n):
        self.n_vocab = n
        self.special_tokens = {}

    def add_special_token(self, text, token_id=None):
        token_id = self.n_vocab if token_id is None else token_id
        self.special_tokens[text] = token_id
        self.n_vocab = max(self.n_vocab, token_id + 1)
        return token_id


@pytest.mark.parametrize("fields", [LLAMA3, QWEN3],
                         ids=["llama3-grow", "qwen3-spare-row"])
def test_export_with_mask_token_loads_in_transformers(tmp_path, fields):
    transformers = pytest.importorskip("transformers")
    ref = hf_model(fields)
    ref.save_pretrained(tmp_path / "base")
    ours = from_pretrained(tmp_path / "base")
    # Llama: the tokenizer fills the matrix, so the matrix grows. Qwen: spare
    # rows beyond the tokenizer (like Qwen3-4B's 151669..151935) are reused.
    llama = fields is LLAMA3
    n_vocab = 320 if llama else 300
    vocab = _Vocab(n_vocab)
    mask_id = add_mask_token(ours, vocab)
    assert mask_id == n_vocab
    assert ours.config.vocab_size == (321 if llama else 320)
    row = ours.tok_emb.weight[mask_id]
    emb = ours.tok_emb.weight[:mask_id]
    assert torch.isfinite(row).all()
    assert 0.3 < row.std() / emb.std() < 3
    # idempotent
    assert add_mask_token(ours, vocab) == mask_id

    # Llama: sharded, Qwen: one file, over an earlier save's shards
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    stale = "model-00001-of-00009.safetensors"
    (mtp / stale).write_text("an earlier save's shard")
    shard = {"max_shard_bytes": 40_000} if llama else {}
    save_pretrained(ours, mtp, **shard)
    files = sorted(f for f in os.listdir(mtp)
                   if f.startswith("model"))
    assert ("model.safetensors.index.json" in files) == llama
    assert stale not in files
    assert len(files) > 5 if llama else files == ["model.safetensors"]
    config = json.loads((mtp / "config.json").read_text())
    assert config["mask_token_id"] == mask_id

    back = transformers.AutoModelForCausalLM.from_pretrained(mtp).eval()
    tokens = torch.tensor([[1, 2, 3, mask_id, mask_id, 7, 8, mask_id]])
    with torch.no_grad():
        diff = back(tokens).logits - ours(tokens)
        assert diff.abs().max() <= 1e-4
    again = from_pretrained(mtp)
    assert again.config.mask_token_id == mask_id


# ---- bad input: one clear error, never a wrong model ------------------------------

@pytest.fixture
def llama_dir(tmp_path):
    pytest.importorskip("transformers")
    hf_model(LLAMA3).save_pretrained(tmp_path)
    return tmp_path


def _edit_config(edit):
    def apply(path):
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return apply


def _edit_tensors(edit):
    def apply(path):
        from safetensors.torch import load_file, save_file
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors")
    return apply


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


# what is wrong -> (how to break a good folder, error, message)
BAD_FOLDERS = {
    "no config": (
        lambda path: (path / "config.json").unlink(),
        FileNotFoundError,
        "no model config at"),
    "unknown model type": (
        _edit_config(lambda c: c.update(model_type="gpt2")),
        ValueError,
        "unsupported model_type 'gpt2'"),
    "malformed config": (
        lambda path: (path / "config.json").write_text("{not json"),
        ValueError,
        "malformed JSON"),
    "missing tensor": (
        _edit_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        ValueError,
        r"missing model\.layers\.1\.mlp\.up_proj\.weight$"),
    "unexpected tensors": (
        _edit_tensors(lambda t: t.update({n: torch.ones(1) for n in "dcba"})),
        ValueError,
        r"unexpected a, b, c and 1 more$"),
    "misshaped tensor": (
        _edit_tensors(lambda t: t.update({"model.norm.weight": torch.ones(63)})),
        ValueError,
        r"wrong shape model\.norm\.weight \[63\] \(expected \[64\]\)$"),
    "truncated weights": (_truncate, ValueError, "truncated or corrupt"),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_bad_checkpoint_is_one_clear_error(llama_dir, case):
    """Never a wrong model and never a traceback: one line that names
    the problem."""
    breaks, error, message = BAD_FOLDERS[case]
    breaks(llama_dir)
    with pytest.raises(error, match=message) as err:
        from_pretrained(llama_dir)
    assert "\n" not in str(err.value)
