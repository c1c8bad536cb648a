"""Figures of the GPU paths, one JSON object per section. benchmarks/gpu_check.sh runs it on a GPU;
every section also runs on a CPU (`--device cpu`), where the memory figures are null.

    python benchmarks/gpu_figures.py SECTION [--device cuda] [--dtype bfloat16] [--json OUT]

Sections
  env        torch, CUDA, cuDNN, the GPU, and whether it computes in bfloat16
  attention  which scaled-dot-product kernel runs, its time and peak memory, for the old call (a
             boolean mask with enable_gqa) and for model.attend, in the training layout's shapes
             (batch 8, packed length 235, 32 heads, 8 KV heads, head dim 128, forward + backward)
             and in decoding's (batch 16, 16 new tokens per row on about 1,000 cached, forward)
  syncs      host-device synchronisations in one ragged ConfAdapt pass of a 30-layer model, and
             per pass of a whole ConfAdapt generation (HostSyncs below)
  decode     median time of one ragged cached pass of a SmolLM2-135M-shaped model (random
             weights) at batch 16, 16 new tokens per row on 256 cached
  bf16       what holds in --dtype: lossless == greedy, and batched == one at a time, as the
             share of identical rows on a random model
  compare    A B: the largest weight difference between two exported model folders
"""
import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
from confadapt import DecodeConfig, decode_pass, generate, prefill  # noqa: E402

aten = torch.ops.aten


class HostSyncs(TorchDispatchMode):
    """Count, by kind, the operations that make the host wait for the device.

    On a GPU each of them waits until all queued work is done: reading a value (.item(), int(),
    bool(), `if tensor:`), .tolist(), and every operation whose output size depends on the data
    (nonzero, masked_select, indexing with a boolean mask). They are counted on any device, so a
    CPU run shows what a GPU run would wait for. (.tolist() is counted by name: code that keeps
    host data in Python lists never calls it on a host tensor.)
    """

    def __enter__(self):
        self.counts = Counter()
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: (self.counts.update(["tolist"]), self._tolist(t))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default):
            self.counts["item"] += 1
        elif func in (aten.nonzero.default, aten.masked_select.default):
            self.counts[func.__name__.split(".")[0]] += 1
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.counts["boolean index"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def environment(device) -> dict:
    cuda = device.type == "cuda"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
            "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
            "memory_gb": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, repeats=5) -> dict:
    """Kernel names (from the profiler), median seconds and peak memory of fn()."""
    fn()                                                                  # warm-up
    _sync(device)
    with torch.profiler.profile() as prof:
        fn()
        _sync(device)
    kernels = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
                      or e.name.startswith("aten::_efficient_attention") or e.name.startswith("aten::_flash_attention")})
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    return {"kernels": kernels, "ms": 1e3 * statistics.median(times), "peak_mib": peak}


def attention(device, dtype) -> dict:
    from data import mtp_layout

    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(5, 100, (8, 160), generator=g)
    layout = mtp_layout(seqs, k=16, offset=0, n_regions=5, mask_id=1, eos_id=2, pad_id=2)     # L = 160 + 5 * 15
    lengths = torch.randint(900, 1024, (16,), generator=g)
    slots = lengths[:, None] + torch.arange(16)                                              # (16, 16)
    cases = {"training": (8, layout.attn_mask.shape[-1], layout.attn_mask.shape[-1], layout.attn_mask[:, None], True),
             "decoding": (16, 16, 1040, torch.arange(1040)[None, None, None, :] <= slots[:, None, :, None], False)}
    out = {}
    for name, (B, T, S, mask, backward) in cases.items():
        q = torch.randn(B, 32, T, 128, device=device, dtype=dtype, requires_grad=backward)
        k, v = (torch.randn(B, 8, S, 128, device=device, dtype=dtype, requires_grad=backward) for _ in range(2))
        mask = mask.to(device)
        calls = {"old: mask + enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                 "model.attend with mask": lambda: M.attend(q, k, v, mask)}
        if T == S:
            calls["model.attend causal"] = lambda: M.attend(q, k, v, None)

        def run(call):
            y = call()
            if backward:
                y.backward(torch.ones_like(y))
        out[name] = {"shape": {"B": B, "T": T, "S": S, "heads": 32, "kv_heads": 8, "head_dim": 128,
                               "backward": backward}, **{c: measure(lambda c=c: run(calls[c]), device) for c in calls}}
    return out


def model_135m(device, dtype, n_layers=30) -> M.Transformer:
    """SmolLM2-135M's shape (random weights): 30 layers, dim 576, 9 heads, 3 KV heads."""
    torch.manual_seed(0)
    cfg = M.ModelConfig(vocab_size=49152, dim=576, n_layers=n_layers, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                        tie_embeddings=True, max_seq_len=2048, mask_token_id=49151)
    return M.Transformer(cfg).to(device=device, dtype=dtype).eval()


def ragged_setup(model, B=16, context=256):
    """A cache of B rows at slightly different lengths and one ConfAdapt-like ragged pass to feed."""
    cache = model.new_cache(B, context + 64)
    prefill(model, cache, {b: list(range(1, context - b)) for b in range(B)}, 0)
    inputs = [[5] * (1 + b % 4) + [model.config.mask_token_id] * 15 for b in range(B)]   # accepted + masks
    return cache, inputs


@torch.inference_mode()
def syncs(device, dtype) -> dict:
    model = model_135m(device, dtype, n_layers=30)
    cache, inputs = ragged_setup(model, B=4, context=64)
    mark = cache.lengths.clone()
    with HostSyncs() as one:
        decode_pass(model, cache, inputs, [len(x) - 16 for x in inputs], [16] * len(inputs), 0)
    cache.rollback(mark)
    prompts = [list(range(1, n)) for n in (9, 17, 30, 12)]
    with HostSyncs() as whole:
        _, stats = generate(model, prompts, 24, DecodeConfig("confadapt", tau=0.5, k_max=8))
    out = {"layers": model.config.n_layers, "one_ragged_pass": dict(one.counts), "one_ragged_pass_total": one.total,
           "generate_passes": stats.forward_passes, "generate_total": whole.total,
           "generate_per_pass": whole.total / stats.forward_passes, "generate": dict(whole.counts)}
    if device.type == "cuda":                         # a second opinion: CUDA's own count of synchronising calls
        import warnings
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            decode_pass(model, cache, inputs, [len(x) - 16 for x in inputs], [16] * len(inputs), 0)
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("default")
        out["one_ragged_pass_cuda_sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
    return out


@torch.inference_mode()
def decode(device, dtype) -> dict:
    model = model_135m(device, dtype)
    cache, inputs = ragged_setup(model)
    mark = cache.lengths.clone()

    def one_pass():
        decode_pass(model, cache, inputs, [len(x) - 16 for x in inputs], [16] * len(inputs), 0)
        cache.rollback(mark)
    return {"model": "SmolLM2-135M shape, random weights", "batch": 16, "cached": 256, "new_per_row": 16,
            "threads": torch.get_num_threads(), **measure(one_pass, device, repeats=7)}


@torch.inference_mode()
def bf16(device, dtype) -> dict:
    torch.manual_seed(0)
    cfg = M.ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128,
                        mask_token_id=63)
    model = M.Transformer(cfg).eval()
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.3)                           # well-separated argmaxes, as in the tests
    model = model.to(device=device, dtype=dtype)
    prompts = [torch.randint(0, 62, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(1, 33)]
    greedy = [g.tokens for g in generate(model, prompts, 40, DecodeConfig("greedy"))[0]]
    alone = [generate(model, [p], 40, DecodeConfig("greedy"))[0][0].tokens for p in prompts]
    lossless = [g.tokens for g in generate(model, prompts, 40, DecodeConfig("lossless", k=8))[0]]
    same = lambda a, b: sum(x == y for x, y in zip(a, b)) / len(a)
    return {"dtype": str(dtype), "rows": len(prompts), "lossless_equals_greedy": same(lossless, greedy),
            "batched_equals_alone": same(greedy, alone)}


def compare(folder_a, folder_b) -> dict:
    """Largest difference between the weights of two exported folders, and their dtypes."""
    a, b = M.read_safetensors(folder_a), M.read_safetensors(folder_b)
    if a.keys() != b.keys():
        raise ValueError(f"{folder_a} and {folder_b} hold different tensors")
    return {"max_abs_diff": max(float((a[n].float() - b[n].float()).abs().max()) for n in a),
            "identical": all(torch.equal(a[n], b[n]) for n in a),
            "dtypes": sorted({str(t.dtype) for t in a.values()} | {str(t.dtype) for t in b.values()})}


SECTIONS = {"env": lambda d, t: environment(d), "attention": attention, "syncs": syncs, "decode": decode, "bf16": bf16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=[*SECTIONS, "compare"])
    p.add_argument("folders", nargs="*", help="compare: two exported model folders")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.section == "compare":
            if len(args.folders) != 2:
                raise ValueError("compare needs two model folders")
            figures = compare(*args.folders)
        else:
            figures = SECTIONS[args.section](M.parse_device(args.device), getattr(torch, args.dtype))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
