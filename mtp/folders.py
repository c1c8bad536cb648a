"""What a model, adapter or run folder says about itself, checked before any weights load;
not part of the method, a learner can skip it.

- An adapter's base fingerprint: a gated mask adapter runs on the base model it was trained
  on and nothing else. Hashing a base of 16 GB at every start would take minutes, so the
  fingerprint hashes what tells checkpoints apart cheaply: config.json, every safetensors
  header (names, dtypes, shapes, offsets) and a fixed sample of the tensor bytes.
- What a tuned folder was trained with (`trained_with.json`: k_max and the prompt format),
  the defaults of the commands that decode it.
- The prompt formats a tokenizer can encode, checked before the weights load.
- A run folder's lock: one run at a time writes into a folder.
"""

import fcntl
import hashlib
import json
import os
import struct
import sys
from functools import lru_cache

from mtp.hf import read_json, safetensors_files
from mtp.tokenizer import FORMATS, end_token, padding_token, prompt_tokens

# The adapter folder's format: 2 adds the base fingerprint; 1 (no field) is read too.
ADAPTER_FORMAT_VERSION = 2
# The tensor bytes hashed: this many windows of this many bytes, evenly spaced over each
# safetensors file's data (about 64 KiB a file, whatever the model's size).
SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 4096
# What export writes beside a tuned model or adapter: the k_max and format it trained with.
TRAINED_WITH = "trained_with.json"


# --- an adapter's base ---

def base_fingerprint(folder) -> str:
    """sha256 over config.json (as JSON, so a re-saved file with a BOM or other spacing
    matches), each safetensors file's header, and SAMPLE_WINDOWS windows of its data."""
    h = hashlib.sha256()
    config = read_json(os.path.join(folder, "config.json"), "model config")
    h.update(json.dumps(config, sort_keys=True).encode())
    for file in safetensors_files(folder):
        with open(file, "rb") as f:
            # a safetensors file: 8 bytes of header length, the JSON header, the data
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"cannot read {file}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            h.update(f.read(n))
            data = os.fstat(f.fileno()).st_size - 8 - n
            window = min(SAMPLE_BYTES, data)
            for i in range(SAMPLE_WINDOWS):
                f.seek(8 + n + (data - window) * i // (SAMPLE_WINDOWS - 1))
                h.update(f.read(window))
    return "sha256:" + h.hexdigest()


def base_record(base_model) -> dict:
    """The fields an adapter's JSON gets about its base."""
    return {"format_version": ADAPTER_FORMAT_VERSION,
            "base_fingerprint": base_fingerprint(base_model)}


@lru_cache(maxsize=None)
def checked_base(adapter, base, named_base) -> str:
    """The base model folder of the adapter folder `adapter`: `base` (--base) if given,
    else `named_base`, the one its JSON names. It must exist and, where the JSON records a
    fingerprint, match it; an adapter without one is taken on trust, with a notice.
    Checked once per process."""
    file = os.path.join(adapter, "mask_adapter.json")
    path = base or named_base
    if not os.path.isfile(os.path.join(path, "config.json")):
        where = f"--base {base}" if base else f"{file} (its base_model)"
        raise FileNotFoundError(f"no base model at {path}, named by {where}: give the "
                                f"base's folder with --base FOLDER, or edit base_model in "
                                f"{file}")
    config = read_json(file, "mask adapter config")
    version = config.get("format_version", 1)
    if not isinstance(version, int) or version > ADAPTER_FORMAT_VERSION:
        raise ValueError(f"{file}: format_version {version!r} is newer than this code "
                         f"reads ({ADAPTER_FORMAT_VERSION}): update the code")
    want = config.get("base_fingerprint")
    if want is None:
        print(f"note: {file} records no fingerprint of its base (written before "
              f"format_version {ADAPTER_FORMAT_VERSION}): {path} is used unchecked",
              file=sys.stderr)
    elif base_fingerprint(path) != want:
        raise ValueError(f"the adapter {adapter} was trained on another base than {path} "
                         f"(its fingerprint in {file} differs): give the right base with "
                         "--base FOLDER")
    return path


# --- what a folder was trained with ---

def trained_with(folder) -> dict:
    """k_max and format from the folder's trained_with.json, else, for a run's final/
    written before that file, from the run's train_args.json ({} if neither)."""
    file = os.path.join(folder, TRAINED_WITH)
    run_args = os.path.join(folder, os.pardir, "train_args.json")
    if os.path.isfile(file):
        record = read_json(file, "training record")
    elif os.path.basename(os.path.normpath(folder)) == "final" and os.path.isfile(run_args):
        file = os.path.normpath(run_args)
        record = read_json(file, "training arguments")
    else:
        return {}
    found = {k: record[k] for k in ("k_max", "format") if k in record}
    return found | {"file": file}


def apply_trained_with(args, k_max_applies=True):
    """Fill --k-max (unset: None) and --format (auto) from --model's trained_with.json,
    the flags given winning; print which came from the folder. k_max_applies: the
    command's decoding rule uses k_max (not with --greedy or --static-k in confadapt)."""
    record = trained_with(args.model)
    used = {}
    k_max = record.get("k_max")
    if k_max_applies and getattr(args, "k_max", 0) is None and isinstance(k_max, int):
        used["k_max"] = max(1, k_max)
    if args.format == "auto" and record.get("format") in FORMATS:
        used["format"] = record["format"]
    vars(args).update(used)
    if used:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in used.items())
        print(f"defaults from {record['file']}: {flags} (as it was trained; give the flags "
              "to override)", file=sys.stderr)


# --- prompt formats ---

def supported_formats(tok) -> list[str]:
    """The formats whose special tokens this tokenizer has: those that encode a prompt
    and end and pad a response."""
    ok = []
    for fmt in FORMATS:
        try:
            prompt_tokens(tok, fmt, "a")
            end_token(tok, fmt)
            padding_token(tok, fmt)
        except (KeyError, ValueError):
            continue
        ok.append(fmt)
    return ok


def check_format(fmt, tok, folder, raw=False):
    """Refuse a --format the tokenizer of `folder` cannot encode, naming those it
    can (raw: the command also takes raw, which any tokenizer encodes)."""
    ok = supported_formats(tok)
    if fmt in ok or fmt == "auto" or (raw and fmt == "raw"):
        return
    if raw:
        ok = ok + ["raw"]
    raise ValueError(f"--format {fmt}: the tokenizer in {folder} has not its special "
                     f"tokens; it supports {', '.join(ok) or 'none'}")


# --- one run per folder ---

class FolderLock:
    """The lock of a run folder, held from `acquire` to `release` (or the process's end).
    flock on the folder itself: no lock file to clean up, and the OS drops the lock with
    its holder, so a run that dies, however, never blocks the next. Under torchrun rank 0
    alone holds it (the other ranks share the folder)."""

    def __init__(self, folder, name=None):
        self.folder = folder
        # how the refusal names the folder
        self.name = name or folder
        self.fd = None
        self.made = False

    def acquire(self):
        if self.fd is not None or int(os.environ.get("RANK", 0)) != 0:
            return self
        self.made = not os.path.isdir(self.folder)
        os.makedirs(self.folder, exist_ok=True)
        self.fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise ValueError(f"{self.name} is in use by another run (a train, eval, data "
                             "or export writing there): wait for it to end, or choose "
                             "another folder") from None
        return self

    def release(self):
        """Unlock; a folder the lock made and nothing filled goes again."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.made and os.path.isdir(self.folder) and not os.listdir(self.folder):
            os.rmdir(self.folder)
        self.made = False
