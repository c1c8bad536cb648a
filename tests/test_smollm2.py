"""A real pretrained model: SmolLM2-135M-Instruct, converted by scripts/get_smollm2.py.

These tests run when the converted folder is at models/smollm2 (`.ci/run` makes it) and are
skipped otherwise. They check that our model, tokenizer and chat format reproduce transformers
on it, and that the converter writes SmolLM2's own tokenizer (mtp.tokenizer.write_gguf_tokenizer):
its pre-tokenizer is checked on StarCoder's vocabulary (the same digits-then-GPT-2 split) against
the reference tokenizations llama.cpp ships, when those files are present (LLAMA_CPP_VOCABS, see
.ci/run).
"""
import os
from pathlib import Path

import pytest
import torch

from confadapt import DecodeConfig
from mtp.tokenizer import CHATML_SYSTEM, Tokenizer, prompt_tokens, write_gguf_tokenizer
from tasks.word_problems import domain_prompts
from mtp.engine import generate
from mtp.hf import from_pretrained, save_pretrained

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "models" / "smollm2"
pytestmark = pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(),
                                reason="no converted SmolLM2: python scripts/get_smollm2.py models/smollm2")
CHAT = ["What is the capital of France?", domain_prompts("word_problems", 1, "test")[0],
        domain_prompts("lists", 1, "test")[0]]


@pytest.fixture(scope="module")
def ours():
    return from_pretrained(SMOLLM2), Tokenizer.from_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(SMOLLM2)


def test_chatml_prompt_equals_apply_chat_template(ours, hf):
    tok, hf_tok = ours[1], hf[1]
    for q in CHAT + ["  spaces, digits 12345 and\nnew lines  "]:
        want = hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
        assert prompt_tokens(tok, "chatml", q) == list(want), q
    assert CHATML_SYSTEM in hf_tok.chat_template


@torch.inference_mode()
def test_logits_and_greedy_continuations_match_transformers(ours, hf):
    model, tok = ours
    hf_model = hf[0]
    prompts = [prompt_tokens(tok, "chatml", q) for q in CHAT]
    for p in prompts:
        ids = torch.tensor([p])
        diff = (model(ids) - hf_model(ids).logits).abs().max().item()
        assert diff <= 1e-3, diff
    gens, _ = generate(model, prompts, 64, DecodeConfig("static", k=1), stop_ids=set(), batch_size=3)
    for p, g in zip(prompts, gens):
        want = hf_model.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert g.tokens == want, tok.decode(g.tokens)
    assert "Paris" in tok.decode(gens[0].tokens)


def test_converter_tokenizer_matches_llama_cpp_references(tmp_path):
    vocabs = Path(os.environ.get("LLAMA_CPP_VOCABS", "/nonexistent"))
    if not (vocabs / "ggml-vocab-starcoder.gguf").is_file():
        pytest.skip("set LLAMA_CPP_VOCABS to llama.cpp's models/ folder (llama-cpp-python's sdist has it)")
    from gguf import GGUFReader
    from tokenizers import Tokenizer as HFTokenizer

    reader = GGUFReader(vocabs / "ggml-vocab-starcoder.gguf")   # a vocab-only file: fill in what it lacks
    extra = {"tokenizer.ggml.pre": "smollm", "llama.context_length": 8192, "tokenizer.chat_template": "",
             "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.padding_token_id": 0,
             "tokenizer.ggml.unknown_token_id": 0}

    def field(name):
        return extra[name] if name in extra else reader.fields[name].contents()

    write_gguf_tokenizer(field, tmp_path)
    hf, ours = HFTokenizer.from_file(str(tmp_path / "tokenizer.json")), Tokenizer.from_pretrained(tmp_path)
    texts = (vocabs / "ggml-vocab-starcoder.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    wants = (vocabs / "ggml-vocab-starcoder.gguf.out").read_text(encoding="utf-8").strip("\n").split("\n")
    assert len(wants) >= 40
    for text, want in zip(texts, wants):
        ids = [int(i) for i in want.split()]
        assert hf.encode(text, add_special_tokens=False).ids == ids, repr(text)
        assert ours.encode(text) == ids, repr(text)


def test_confadapt_command_speaks_the_chat_format_as_transformers_does(hf, tmp_path, capsys):
    """confadapt.py on a SmolLM2 folder with <mask> (an export's layout), --format auto: the prompt
    becomes the user's message in ChatML, with no BOS the template does not add; its greedy answer
    is transformers' apply_chat_template + generate."""
    import json

    import confadapt
    from model import add_mask_token

    model, tok = from_pretrained(SMOLLM2), Tokenizer.from_pretrained(SMOLLM2)
    add_mask_token(model, tok)
    save_pretrained(model, tmp_path)
    tok.save_pretrained(tmp_path)
    question = "What is the capital of France?"
    assert confadapt.main(["--model", str(tmp_path), "--prompt", question, "--greedy", "--max-new-tokens", "16",
                           "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    hf_model, hf_tok = hf
    ids = hf_tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=False)
    want = hf_model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert got["prompt_tokens"] == ids.shape[1]
    assert got["tokens"] == want[:len(got["tokens"])]
    assert "Paris" in got["text"]
