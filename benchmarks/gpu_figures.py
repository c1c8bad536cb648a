"""Figures of the GPU paths, one JSON object per section. benchmarks/gpu_check.sh runs every
section on a GPU; each also runs on a CPU (`--device cpu --small`: the same code at small shapes,
to check the script), where the memory figures are null.

    python benchmarks/gpu_figures.py SECTION [--device cuda] [--dtype auto] [--small] [--json OUT]

Sections
  env         torch, CUDA, cuDNN, the GPU, and whether it computes in bfloat16 natively
  kernels     which scaled-dot-product kernel serves each call shape of model.attend (training
              layout, causal, prefill, decoding passes, a one-token prompt), in float32 and
              bfloat16, under --cudnn-attention off and auto, with the layout of the kernel's
              output and its time; a case that fails is recorded with its error, the others run
  latency     one cached forward pass of T = 1..32 new positions per row, batch 1 and 16, on
              SmolLM2-135M-shaped and Llama-3.1-8B-shaped random weights (as many 8B layers as
              memory allows)
  decode      tokens/s of greedy, ConfAdapt and lossless decoding on a SmolLM2-135M-shaped model
              whose every prediction is made confident on purpose (its logits scaled by 1000): each
              ConfAdapt pass keeps k_max tokens, so the passes have the shapes of a tuned model's
  train_step  one distillation step (student + frozen teacher, AdamW) at the paper's shapes, on 2
              and 4 Llama-3.1-8B-shaped layers: time and peak memory, extrapolated to 32 layers
  syncs       host-device synchronisations in one ragged ConfAdapt pass, and the most in any
              decoding pass of `generate` (ConfAdapt, with and without the gated adapter)
  bf16        what holds in --dtype: lossless == greedy, batched == one at a time (share of rows)
  smoke_model DIR: write a tiny random grouped-query model (4 heads, 2 KV heads) with a tokenizer
  compare     A B: the largest weight difference between two exported model folders
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
from mtp import engine  # noqa: E402
from mtp.cli import (CUDNN_ATTENTION, add_flags, apply_attention_backend,  # noqa: E402
                     native_bfloat16_gpu, parse_device, parse_dtype)
from mtp.engine import (HostSyncs, decode_pass, generate, new_cache, prefill,  # noqa: E402
                        synchronize)
from adapter import add_mask_adapter  # noqa: E402
from mtp.hf import read_safetensors, save_pretrained  # noqa: E402
from confadapt import DecodeConfig  # noqa: E402
from data import mtp_layout
from tasks.word_problems import word_problem_tokenizer
from distill import frozen_teacher, mtp_loss  # noqa: E402


# The two model shapes the figures are about (random weights: only the shapes matter here).
SMOLLM2 = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
               tie_embeddings=True, max_seq_len=2048)
LLAMA8B = dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               rope_theta=500000.0, max_seq_len=4096)
# --small (a CPU dry run): the same code at a size a CPU runs in seconds.
SMALL = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
             max_seq_len=2048)


def shapes(small: bool) -> dict:
    """The shapes a section measures, by name: the two real ones, or the small stand-in."""
    return {"small stand-in": SMALL} if small else {"smollm2": SMOLLM2, "llama8b": LLAMA8B}


def random_model(shape: dict, device, dtype, n_layers=None) -> M.Transformer:
    """A model of this shape with random weights, built on the device in its dtype."""
    torch.manual_seed(0)
    cfg = M.ModelConfig(**{**shape, "n_layers": n_layers or shape["n_layers"]})
    cfg.mask_token_id = cfg.vocab_size - 1
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy of an 8B model on the way
    try:
        with torch.device(device):
            model = M.Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def median_seconds(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment(device, dtype, small) -> dict:
    cuda = device.type == "cuda"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "native_bf16": native_bfloat16_gpu(device),
        "auto_dtype": str(parse_dtype("auto", device)),
        "memory_gb": (
            round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
            if cuda
            else None
        ),
    }


def attention_calls(shape: dict, small: bool) -> dict:
    """name -> (B, T, S, mask, backward): the shapes in which the model calls attention."""
    g = torch.Generator().manual_seed(0)
    rows, n_tokens = (2, 40) if small else (8, 160)
    seqs = torch.randint(5, 100, (rows, n_tokens), generator=g)
    layout = mtp_layout(
        seqs, k=16 if not small else 4, offset=0, n_regions=5, mask_id=1, eos_id=2, pad_id=2
    )
    L = layout.attn_mask.shape[-1]
    cached = 256 if small else 1024

    def decoding(B, T):  # a cached pass: T new tokens after `cached` ones
        slots = cached + torch.arange(T)
        mask = torch.arange(cached + T)[None, None, None, :] <= slots[None, None, :, None]
        return B, T, cached + T, mask, False

    return {
        "training layout (mask, forward + backward)": (rows, L, L, layout.attn_mask[:, None], True),
        "causal training (no mask)": (rows, n_tokens, n_tokens, None, True),
        "prefill of 100 tokens (cached)": (1, 100, 100, torch.ones(100, 100).bool().tril(), False),
        "decoding, batch 1, 4 new tokens": decoding(1, 4),
        "decoding, batch 16, 16 new tokens": decoding(16, 16),
        "one-token prompt (key length 1)": (1, 1, 1, torch.ones(1, 1, 1, 1).bool(), False),
    }


def kernel_case(device, dt, shape, B, T, S, mask, backward) -> dict:
    """One call shape in one dtype: the kernel the profiler saw, the layout of the raw kernel
    output (contiguous, or transposed as the memory-efficient kernel returns it), the time."""
    layouts = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):  # model.attend's call, output layout noted
        y = sdpa(*args, **kwargs)
        layouts.append("contiguous" if y.is_contiguous() else f"strides {tuple(y.stride())}")
        return y

    H, n_kv, hd = shape["n_heads"], shape["n_kv_heads"], shape["dim"] // shape["n_heads"]
    q = torch.randn(B, H, T, hd, device=device, dtype=dt, requires_grad=backward)
    k, v = (
        torch.randn(B, n_kv, S, hd, device=device, dtype=dt, requires_grad=backward)
        for _ in "kv"
    )
    m = None if mask is None else mask.to(device)

    def run():
        y = M.attend(q, k, v, m)
        if backward:
            y.backward(torch.ones_like(y))

    F.scaled_dot_product_attention = recording
    try:
        with torch.profiler.profile() as prof:
            run()
            synchronize(device)
    finally:
        F.scaled_dot_product_attention = sdpa
    ops = {e.name for e in prof.events() if e.name.startswith("aten::_")}
    return {
        "B": B,
        "T": T,
        "S": S,
        "heads": H,
        "kv_heads": n_kv,
        "head_dim": hd,
        "kernels": sorted(name for name in ops if "attention" in name),
        "output": layouts[0],
        "ms": 1e3 * median_seconds(run, device, 5),
    }


def kernels(device, dtype, small) -> dict:
    """kernel_case for each call shape, dtype and --cudnn-attention setting (on CUDA: off and
    auto; the CPU has its own kernels). A case that fails keeps its error; the others run."""
    cuda = device.type == "cuda"
    settings = ["off", "auto"] if cuda else ["off"]
    out = {}
    for setting in settings:
        apply_attention_backend(setting, device)
        for shape_name, shape in shapes(small).items():
            for call, (B, T, S, mask, backward) in attention_calls(shape, small).items():
                for dt in ([torch.float32, torch.bfloat16] if cuda else [dtype]):
                    name = f"{shape_name} | {call} | {str(dt).removeprefix('torch.')}"
                    if cuda:
                        name += f" | cudnn-attention {setting}"
                    try:
                        out[name] = kernel_case(device, dt, shape, B, T, S, mask, backward)
                    except Exception as e:  # any failure of this case, recorded
                        line = " ".join(str(e).split())[:300]
                        out[name] = {"error": f"{type(e).__name__}: {line}"}
                    if cuda:
                        torch.cuda.empty_cache()
    apply_attention_backend("off", device)
    failed = [name for name, case in out.items() if "error" in case]
    return {"failed": failed, "cases": out}


def latency(device, dtype, small) -> dict:
    """Milliseconds of one cached pass of T new positions per row at batch 1 and 16."""
    from bench_modes import forward_latency  # benchmarks/, beside this file

    sizes = [1, 2, 4, 8] if small else list(range(1, 33))
    out = {}
    for name, shape in shapes(small).items():
        n_layers = None
        if name == "llama8b" and device.type == "cuda":
            # 32 layers in bfloat16: 16 GB; fewer where memory is tight
            free = torch.cuda.mem_get_info(device)[0] / 2**30
            n_layers = 32 if free > 40 else 8
        model = random_model(shape, device, dtype, n_layers)
        curves = {
            bs: {T: 1e3 * s for T, s in forward_latency(model, bs, 256, sizes, repeats=5).items()}
            for bs in (1, 16)
        }
        out[name] = {
            "layers": model.config.n_layers,
            "dtype": str(dtype),
            "context": 256,
            "ms": curves,
        }
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def decode(device, dtype, small) -> dict:
    """Decoding speed on SmolLM2's shape, every prediction confident: scaling the final norm's
    weight by 1000 scales every logit by 1000, so each top-1 probability is near 1 and ConfAdapt
    keeps k_max tokens per pass (lossless still keeps only drafts its next pass confirms)."""
    model = random_model(SMALL if small else SMOLLM2, device, dtype)
    model.norm.weight.mul_(1000.0)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 1000 if not small else 500, (n,), generator=g).tolist()
        for n in range(48, 64)
    ]
    n_new = 32 if small else 128
    modes = [
        DecodeConfig("static", k=1),
        DecodeConfig("confadapt", tau=0.9, k_max=4),
        DecodeConfig("lossless", k=4),
    ]
    out = {}
    for bs in (1, 16):
        for mode in modes:
            rows = prompts[:1] if bs == 1 else prompts
            generate(model, rows, 8, mode, batch_size=bs)  # warm-up
            _, stats = generate(model, rows, n_new, mode, batch_size=bs)
            out[f"batch {bs} | {mode.describe()}"] = {
                "tokens_per_second": stats.tokens_per_second,
                "tokens_per_pass": stats.effective_k,
                "forward_passes": stats.forward_passes,
            }
        greedy = out[f"batch {bs} | greedy"]["tokens_per_second"]
        for key in out:
            if key.startswith(f"batch {bs} |"):
                out[key]["vs_greedy"] = out[key]["tokens_per_second"] / greedy
    return {
        "model": f"{'small stand-in' if small else 'SmolLM2-135M'} shape, random weights, logits x1000",
        "dtype": str(dtype),
        "new_tokens": n_new,
        **out,
    }


def train_step(device, dtype, small) -> dict:
    """One hard-distillation step as finetune_hf.py takes it: float32 master weights, compute in
    `dtype` (autocast), a frozen teacher in `dtype`, AdamW. The paper's shapes: 8 rows of 160
    tokens a micro-batch, k = 16, 5 regions. Time and peak memory on 2 and 4 layers; one layer
    costs their difference / 2, so 32 layers cost the 2-layer figure + 30 of those."""
    shape, rows, seq_len, k = (SMALL, 2, 40, 4) if small else (LLAMA8B, 8, 160, 16)
    figures = {}
    for n_layers in (2, 4):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        student = random_model(shape, device, torch.float32, n_layers).train()
        teacher = frozen_teacher(student).to(dtype)
        optimizer = student.configure_optimizer(lr=1e-5, weight_decay=0.0)
        seqs = torch.randint(5, 500, (rows, seq_len), generator=torch.Generator().manual_seed(0))
        batch = mtp_layout(
            seqs, k=k, offset=0, n_regions=5, mask_id=student.config.mask_token_id
        ).to(device)

        def step():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss, _ = mtp_loss(student, teacher, batch, mode="hard")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = median_seconds(step, device, 3)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        figures[n_layers] = {"seconds": seconds, "peak_gb": peak}
        del student, teacher, optimizer
    per_layer = {
        key: (figures[4][key] - figures[2][key]) / 2 if figures[2][key] is not None else None
        for key in ("seconds", "peak_gb")
    }
    at_32 = {
        key: figures[2][key] + 30 * per_layer[key] if per_layer[key] is not None else None
        for key in ("seconds", "peak_gb")
    }
    return {
        "shape": "tiny (--small)" if small else "Llama-3.1-8B",
        "rows": rows,
        "seq_len": seq_len,
        "k": k,
        "regions": 5,
        "compute_dtype": str(dtype),
        "measured": figures,
        "per_layer": per_layer,
        "extrapolated_32_layers": at_32,
    }


@torch.inference_mode()
def syncs(device, dtype, small) -> dict:
    model = random_model(SMALL if small else SMOLLM2, device, dtype)
    cache = new_cache(model, 4, 128)
    prefill(model, cache, {b: list(range(1, 60 - b)) for b in range(4)}, 0)
    masks = [model.config.mask_token_id] * 15
    inputs = [[5] * (1 + b % 4) + masks for b in range(4)]  # accepted tokens, then masks
    mark = cache.lengths.clone()
    with HostSyncs() as one:
        decode_pass(model, cache, inputs, [len(x) - 16 for x in inputs], [16] * len(inputs), 0)
    cache.rollback(mark)
    prompts = [list(range(1, n)) for n in (9, 17, 30, 12)]
    with HostSyncs() as whole:
        _, stats = generate(model, prompts, 24, DecodeConfig("confadapt", tau=0.5, k_max=8))
    most = {"base": most_syncs_of_a_pass(model, prompts)}
    add_mask_adapter(model, rank=8, alpha=16.0)
    model.to(device)
    most["gated adapter"] = most_syncs_of_a_pass(model, prompts)
    return {
        "most_in_a_decoding_pass": most,
        "layers": model.config.n_layers,
        "one_ragged_pass": dict(one.counts),
        "one_ragged_pass_total": one.total,
        "generate_passes": stats.forward_passes,
        "generate_total": whole.total,
        "generate_per_pass": whole.total / stats.forward_passes,
        "generate": dict(whole.counts),
    }


def most_syncs_of_a_pass(model, prompts) -> int:
    """The most host syncs any decoding pass of a ConfAdapt `generate` makes."""
    mode = DecodeConfig("confadapt", tau=0.5, k_max=8)
    per_pass, _ = engine.syncs_per_pass(model, prompts, 24, mode, batch_size=3)
    return max(per_pass)


@torch.inference_mode()
def bf16(device, dtype, small) -> dict:
    torch.manual_seed(0)
    cfg = M.ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        max_seq_len=128, mask_token_id=63)
    model = M.Transformer(cfg).eval()
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.3)  # well-separated argmaxes, as in the tests
    model = model.to(device=device, dtype=dtype)
    prompts = [
        torch.randint(0, 62, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in range(1, 33)
    ]
    greedy = [g.tokens for g in generate(model, prompts, 40, DecodeConfig("static", k=1))[0]]
    alone = [generate(model, [p], 40, DecodeConfig("static", k=1))[0][0].tokens for p in prompts]
    lossless = [g.tokens for g in generate(model, prompts, 40, DecodeConfig("lossless", k=8))[0]]

    def same(a, b):
        return sum(x == y for x, y in zip(a, b)) / len(a)

    return {
        "dtype": str(dtype),
        "rows": len(prompts),
        "lossless_equals_greedy": same(lossless, greedy),
        "batched_equals_alone": same(greedy, alone),
    }


def smoke_model(folder) -> dict:
    """A random grouped-query Llama (4 heads sharing 2 KV heads) with the word-problem tokenizer:
    every masked attention call of training, evaluation and decoding takes the grouped path."""
    tok = word_problem_tokenizer()
    cfg = M.ModelConfig(vocab_size=tok.n_vocab, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=128, max_seq_len=512, bos_token_id=tok.bos_id,
                        eos_token_id=tok.eos_id)
    torch.manual_seed(0)
    save_pretrained(M.Transformer(cfg), folder)
    tok.save_pretrained(folder)
    return {"folder": str(folder), "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads}


def compare(folder_a, folder_b) -> dict:
    """Largest difference between the weights of two exported folders, and their dtypes."""
    a, b = read_safetensors(folder_a), read_safetensors(folder_b)
    if a.keys() != b.keys():
        raise ValueError(f"{folder_a} and {folder_b} hold different tensors")
    return {
        "max_abs_diff": max(float((a[n].float() - b[n].float()).abs().max()) for n in a),
        "identical": all(torch.equal(a[n], b[n]) for n in a),
        "dtypes": sorted({str(t.dtype) for t in a.values()} | {str(t.dtype) for t in b.values()}),
    }


SECTIONS = {
    "env": environment,
    "kernels": kernels,
    "latency": latency,
    "decode": decode,
    "train_step": train_step,
    "syncs": syncs,
    "bf16": bf16,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=[*SECTIONS, "smoke_model", "compare"])
    p.add_argument(
        "folders", nargs="*", help="smoke_model: the folder to write; compare: two model folders"
    )
    p.add_argument("--device", default="cuda", help="cuda (the default), cuda:N or cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto (the default): bfloat16 on a GPU that computes it natively, else float32",
    )
    p.add_argument(
        "--small", action="store_true", help="small shapes: a dry run of the script on a CPU"
    )
    p.add_argument("--threads", type=int, default=None)
    add_flags(p, CUDNN_ATTENTION)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.section in ("smoke_model", "compare"):
            wanted = {"smoke_model": 1, "compare": 2}[args.section]
            if len(args.folders) != wanted:
                raise ValueError(f"{args.section} takes {wanted} folder(s)")
            figures = (smoke_model if args.section == "smoke_model" else compare)(*args.folders)
        else:
            device = parse_device(args.device)
            apply_attention_backend(args.cudnn_attention, device)
            figures = SECTIONS[args.section](device, parse_dtype(args.dtype, device), args.small)
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
