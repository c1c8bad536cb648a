"""The command-line plumbing the scripts share; not part of the method.

confadapt.py, train_toy.py, finetune_hf.py and the benchmarks read their arguments, check paths,
report progress and load models the same way, so that is written once, here. A user's mistake (a
bad number, a missing file) is found before any work and ends in one line `error: ...` and exit
status 2, never a traceback; Ctrl-C ends in one line saying what is saved (exit status 130).
"""

import argparse
import json
import os
import pickle
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from adapter import is_adapter_folder, load_mask_adapter, read_adapter_config
from model import add_mask_token
from mtp.folders import apply_trained_with, check_format, checked_base
from mtp.hf import from_pretrained
from mtp.tokenizer import FORMATS, Tokenizer, default_format, end_token, prompt_tokens


# --- one-line errors ---

class CliError(Exception):
    """A bad command line: run_cli prints it as one line and exits 2."""


class Help(argparse.HelpFormatter):
    """--help shows a flag's default where it has a real one, never "(default: None)"."""

    def _get_help_string(self, action):
        d = action.default
        no_default = d is None or d is False or d == argparse.SUPPRESS
        if no_default or "default" in (action.help or ""):
            return action.help
        if isinstance(d, list):
            d = " ".join(map(str, d))
        return f"{action.help or ''} (default: {d})".strip().replace("%", "%%")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=Help, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):
        # one line, no usage dump: run_cli prints it and exits 2
        raise CliError(message)


def run_cli(body, argv) -> int:
    try:
        body(argv)
        return 0
    # OSError: the files (FileNotFoundError too)
    except (CliError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"interrupted{': ' + str(e) if e.args else ''}", file=sys.stderr)
        return 130


# --- argument types and paths ---

def number(kind, low, high=None, low_open=False):
    """An argparse type: a `kind` (int or float) from `low` (excluded when
    low_open) up to `high` (included; None: no limit)."""
    if high is not None:
        where = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low_open:
        where = f"above {low:g}"
    else:
        where = f"at least {low:g}"

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        # x != x: not a number (nan)
        too_low = x < low or (low_open and x == low)
        if too_low or (high is not None and x > high) or x != x:
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return x

    return parse


# sizes, steps, counts
positive_int = number(int, 1)
# 0 allowed (usually: "all" or "off")
count = number(int, 0)
# learning rates, clipping norms, seconds
positive_float = number(float, 0, low_open=True)
# thresholds tau
probability = number(float, 0, 1, low_open=True)


def add_flags(group, *rows):
    """One add_argument per row (flag, type, default, help), a fifth item, a dict,
    holding a row's other keyword arguments (nargs, choices): a command's flags
    that take a value, written as a table."""
    for flag, type, default, help, *more in rows:
        group.add_argument(flag, type=type, default=default, help=help, **dict(*more))


def input_path(path, flag, folder=False):
    kind, other = ("folder", "a file") if folder else ("file", "a folder")
    if not os.path.exists(path):
        raise CliError(f"{flag} {path}: no such {kind}")
    if folder != os.path.isdir(path):
        raise CliError(f"{flag} {path}: is {other}, expected a {kind}")
    return path


def output_folder(path, flag):
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"{flag} {path}: is a file, expected a folder")
    # the nearest folder that exists must take the new ones
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CliError(f"{flag} {path}: {parent} is a file, so no folder can be made there")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {path}: {parent} is not writable")
    return path


# --- progress ---

class Progress:
    """When to print a progress line: the first and the last, else at most one
    every `seconds`."""

    def __init__(self, seconds=10.0):
        self.seconds = seconds
        self.last = None

    def due(self, last=False) -> bool:
        now = time.perf_counter()
        due = last or self.last is None or now - self.last >= self.seconds
        if due:
            self.last = now
        return due


def format_seconds(s) -> str:
    """1h02m05s, or 2m05s under an hour."""
    s = int(max(0, s))
    h, m = divmod(s // 60, 60)
    if h:
        return f"{h}h{m:02d}m{s % 60:02d}s"
    return f"{m}m{s % 60:02d}s"


# --- devices and dtypes ---

def parse_device(name) -> torch.device:
    """--device cpu, cuda, cuda:N or auto -> torch.device; a missing GPU is an
    error, not the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"(cpu|cuda)(:\d+)?", name):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or auto")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine "
                         f"(this torch, {torch.__version__}, sees no GPU); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ValueError(f"device {name!r} requested, but this machine has {n} CUDA GPU(s)")
    return device


def native_bfloat16_gpu(device: torch.device) -> bool:
    """A CUDA GPU that computes in bfloat16 natively (Ampere and newer); a T4, a
    V100 or an RTX 20xx only emulates it, slowly, though
    torch.cuda.is_bf16_supported() says yes there."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def native_bfloat16_cpu() -> bool:
    """A CPU with bfloat16 instructions (AVX-512 BF16 or AMX), as Linux lists its
    flags; other CPUs emulate bfloat16, slower than float32."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.is_file() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_dtype(name, device) -> torch.dtype:
    """--dtype auto: bfloat16 where `device` computes it natively (a GPU from
    Ampere on, a CPU with AVX-512 BF16 or AMX), float32 elsewhere, where bfloat16
    is emulated and slow. Every command resolves auto here."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        native = native_bfloat16_gpu(device)
    else:
        native = native_bfloat16_cpu()
    return torch.bfloat16 if native else torch.float32


# --- attention kernels ---

# The flag of every command that decodes, trains or serves (add_flags takes it as a row).
CUDNN_ATTENTION = (
    "--cudnn-attention", None, "off",
    "CUDA only. off (the default): scaled-dot-product attention uses only its "
    "memory-efficient and math kernels, not cuDNN (which plans each new shape again and "
    "has open defects with masks) nor flash; auto: torch chooses among all of them. "
    "A CPU keeps its own kernels either way", {"choices": ("auto", "off")})

# torch.backends.cuda's switch of each kernel (all in torch 2.6 and later)
SDPA_KERNELS = {"cudnn": "cudnn", "flash": "flash", "memory-efficient": "mem_efficient",
                "math": "math"}


def apply_attention_backend(choice: str, device: torch.device) -> list[str]:
    """Apply --cudnn-attention for a command on `device` -> the kernels CUDA's
    scaled_dot_product_attention may choose from. The switches are process-wide and
    CUDA's: on a CPU nothing is switched (its own choice of kernel holds)."""
    if device.type == "cuda":
        on = choice == "auto"
        torch.backends.cuda.enable_cudnn_sdp(on)
        torch.backends.cuda.enable_flash_sdp(on)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)
    backends = torch.backends.cuda
    return [name for name, key in SDPA_KERNELS.items()
            if getattr(backends, f"{key}_sdp_enabled")()]


# --- a model and its tokenizer for a command ---

def add_model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True,
                   help="Hugging Face layout folder (config.json, safetensors, "
                   "tokenizer.json), or a gated mask adapter's folder")
    g.add_argument("--base", default=None,
                   help="an adapter's base model folder, if not where its "
                   "mask_adapter.json says (checked against its fingerprint)")
    g.add_argument("--device", default="auto",
                   help="auto (the default: cuda when available, else cpu), cpu, cuda or "
                   "cuda:N")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute; auto (the default): bfloat16 where the "
                   "hardware computes it natively (a GPU from Ampere on, a CPU with "
                   "AVX-512 BF16 or AMX), else float32")
    g.add_argument("--format", default="auto", choices=["auto", "raw", *FORMATS],
                   help="how --prompt becomes tokens. auto (the default): the format "
                   "the folder was trained in (its trained_with.json), else the model's "
                   "chat format (llama3-chat, chatml or qwen) with --prompt as the "
                   "user's message, when its tokenizer has one, else raw; raw: the "
                   "text itself after the model's BOS token (finetune_hf.py's auto "
                   "picks plain there, the text and a blank line: the format it trains "
                   "such a model in)")
    g.add_argument("--no-bos", action="store_true",
                   help="raw: do not put the model's BOS token first")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice; small models "
                   "on a busy machine: 1 is fastest and steadiest)")
    add_flags(g, CUDNN_ATTENTION)
    add_calibration_flag(g)


def load_tokenizer(path):
    try:
        return Tokenizer.from_pretrained(path)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        # JSON syntax, UTF-8, a missing field: one line that names the file
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"cannot read the tokenizer in {path} (tokenizer.json): "
                         f"{type(e).__name__}: {e}") from None


def base_folder(path, base=None) -> str:
    """The model folder itself, or the base model of a gated mask adapter folder:
    `base` (--base) if given, else the one it names; either must be the one it was
    trained on (mtp.folders.checked_base)."""
    if is_adapter_folder(path):
        named = read_adapter_config(path)["base_model"]
        return checked_base(os.path.normpath(path), base, named)
    if base is not None:
        raise CliError(f"--base {base}: --model {path} is not a gated mask adapter "
                       "(no mask_adapter.json)")
    return path


def check_model_folder(args, raw=True, k_max_applies=True, defaults=True):
    """What a command that reads --model checks before any weights load: the base an
    adapter names (or --base) is there and is the one it was trained on; with
    `defaults`, --k-max (None: unset) and --format auto take what the folder was
    trained with; the format is one the tokenizer encodes (raw: the command takes raw
    too)."""
    input_path(args.model, "--model", folder=True)
    base = base_folder(args.model, getattr(args, "base", None))
    if defaults:
        apply_trained_with(args, k_max_applies)
    check_format(args.format, load_tokenizer(base), base, raw=raw)


def add_calibration_flag(group):
    """--no-calibration, the flag of every command that loads a model to decode."""
    group.add_argument("--no-calibration", action="store_true",
                       help="a gated mask adapter: ConfAdapt reads its mask predictions' "
                       "confidences from the plain softmax, not through the temperatures "
                       "finetune_hf.py calibrate stored in its folder")


def load_model(path, device="cpu", dtype=torch.float32, base=None, calibrated=True):
    """Model (eval mode), tokenizer, mask id (None without one) and stop ids of a
    model folder, or of a gated mask adapter folder: its base model with <mask>
    added, then the adapter (calibrated: with its temperatures, where it has them)."""
    base = base_folder(path, base)
    model = from_pretrained(base, device=device, dtype=dtype)
    tokenizer = load_tokenizer(base)
    if base != path:
        add_mask_token(model, tokenizer)
        load_mask_adapter(model, path, calibrated)

    cfg = model.config
    mask_id = cfg.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.mask_id
    if mask_id is not None and not 0 <= mask_id < cfg.vocab_size:
        raise ValueError(f"mask token id {mask_id} is outside the model's vocabulary of "
                         f"{cfg.vocab_size}")
    return model, tokenizer, mask_id, stop_ids_of(model, tokenizer)


def stop_ids_of(model, tokenizer) -> set:
    """The config's eos_token_id (one or a list) and the tokenizer's end-of-turn
    tokens."""
    eos = model.config.eos_token_id
    if not isinstance(eos, list):
        eos = [eos]
    return {t for t in eos if t is not None} | set(tokenizer.stop_ids)


def load(args, mode):
    """Model, tokenizer, mask id and stop ids for a decoding command (--model,
    --device, --dtype, --threads, --cudnn-attention); a model without <mask> is refused where `mode`
    (a DecodeConfig) needs one."""
    input_path(args.model, "--model", folder=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    apply_attention_backend(args.cudnn_attention, device)
    model, tokenizer, mask_id, stop_ids = load_model(args.model, device, dtype, args.base,
                                                     not args.no_calibration)
    if mode.block > 1 and mask_id is None:
        raise ValueError(f"model {args.model} has no mask token (no mask_token_id in "
                         "config.json, no <mask> in the tokenizer): only --greedy works; "
                         "add one with model.add_mask_token and fine-tune")
    return model, tokenizer, mask_id, stop_ids


def exactness(mode: str) -> str:
    """The lossless mode's caveat, for output that names a decoder: a pass's shape
    changes bfloat16's rounding, so lossless equals greedy exactly in float32 only."""
    if not mode.startswith("lossless"):
        return ""
    return " (exact in float32; up to rounding in bfloat16)"


def prompt_format(name, tokenizer, model) -> str:
    """--format auto: the model's chat format when its tokenizer has one, else raw
    text."""
    if name != "auto":
        return name
    fmt = default_format(tokenizer, model.config.model_type)
    return "raw" if fmt == "plain" else fmt


def chat_stop_ids(stop_ids, tokenizer, fmt) -> set:
    """In a chat format the end of the assistant's turn stops generation too."""
    if fmt == "raw":
        return stop_ids
    return stop_ids | {end_token(tokenizer, fmt)}


def encode_prompt(tokenizer, model, text, fmt, no_bos=False) -> list[int]:
    """raw: BOS (unless no_bos) + the text; a chat format: the text as the user's
    message, up to where the assistant's answer starts, with the special tokens
    the format's template adds."""
    if fmt != "raw":
        if no_bos:
            raise CliError(f"--no-bos applies to raw prompts; this one is in the {fmt} "
                           "format (--format raw gives the text as it is)")
        return prompt_tokens(tokenizer, fmt, text)
    bos = model.config.bos_token_id
    if no_bos or bos is None:
        return tokenizer.encode(text)
    return [bos] + tokenizer.encode(text)


# --- files: rows, checkpoints, and what every results.json records ---

def read_rows(path, choices=None) -> list:
    """The rows (dicts) of a JSON array or JSONL file; with `choices`, their
    first field tuple."""
    try:
        # utf-8-sig: a byte-order mark (Notepad writes one) is no error
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None

    if text.lstrip().startswith("["):
        rows = json_value(text, f"{path}: malformed JSON array")
    else:
        # JSONL: one row a line, blank lines skipped
        lines = enumerate(text.splitlines(), 1)
        rows = [json_value(line, f"{path} line {i}: malformed JSON")
                for i, line in lines if line.strip()]

    if not rows:
        raise ValueError(f"{path} holds no rows")
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every row must be a JSON object")
    if choices is None:
        return rows
    return fields_of(rows, path, choices)


def json_value(text, where):
    """json.loads, its error told in one line that says where."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {e}") from None


def fields_of(rows: list[dict], path, choices) -> list[tuple]:
    """The first tuple of fields in `choices` that the rows have, as tuples of
    text."""
    fields = next((fs for fs in choices if all(f in rows[0] for f in fs)), None)
    if fields is None:
        want = " or ".join(" and ".join(map(repr, fs)) for fs in choices)
        raise ValueError(f"{path}: expected rows with {want}; "
                         f"the first row has {sorted(rows[0])}")
    for i, row in enumerate(rows, 1):
        if not all(isinstance(row.get(f), str) for f in fields):
            names = " or ".join(repr(f) for f in fields)
            raise ValueError(f"{path}: row {i} lacks a text field {names}")
    return [tuple(r[f] for f in fields) for r in rows]


def read_checkpoint(path, what="checkpoint", weights_only=False):
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except (EOFError, RuntimeError, OSError, ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"cannot read the {what} {path}: truncated or corrupt "
                         f"({type(e).__name__})") from None


def cpu_name() -> str:
    """The CPU's model name, core count and widest bfloat16 support ("AMD EPYC
    ..., 2 cores, avx512_bf16"): two CPUs of one name can round differently, so
    results.json names both."""
    name = platform.processor() or platform.machine()
    flags = ""
    if os.path.isfile("/proc/cpuinfo"):
        info = Path("/proc/cpuinfo").read_text()
        names = (line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name"))
        name = next(names, name)
        words = info.split()
        widest = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
        flags = next((f for f in widest if f in words), "")
    return f"{name}, {os.cpu_count()} cores" + (f", {flags}" if flags else "")


def compute_dtype(model) -> torch.dtype:
    """The dtype a model computes in: its embedding's (an adapter keeps its own
    small tensors in float32, whatever the model's dtype)."""
    return model.tok_emb.weight.dtype


def provenance(dtype: torch.dtype, device=None) -> dict:
    """What every results.json records, so that its figures are compared only
    with figures of the same code, CPU and dtype: the commit (None outside git),
    the CPU, the device and compute dtype, torch, and the CPU threads (in bfloat16
    they change the rounding, and so a greedy text, on a CPU)."""
    commit = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
        if git.returncode == 0:
            commit = git.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": commit or None,
            "cpu": cpu_name(),
            **({"device": str(device)} if device is not None else {}),
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "threads": torch.get_num_threads()}
