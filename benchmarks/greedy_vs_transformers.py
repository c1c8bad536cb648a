"""Benchmark: plain greedy decoding (k=1) with our KV cache against transformers' `generate`.

Both decode the same random Llama-style weights (about 40M parameters, written once in the
Hugging Face layout and loaded by both), from the same prompts, for the same number of tokens,
in one run, so the printed ratio compares like with like on this machine at this moment.
The two greedy continuations must also be identical: a fast wrong answer counts for nothing.

    python benchmarks/greedy_vs_transformers.py [--new-tokens 128] [--repeats 3] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Transformer  # noqa: E402


@torch.no_grad()
def greedy_ours(model, prompt, n):
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + n)
    x, out = prompt, []
    for _ in range(n):
        x = model(x, cache=cache, output_index=torch.full((x.shape[0], 1), x.shape[1] - 1)).argmax(-1)  # (B, 1)
        out.append(x)
    return torch.cat(out, 1)


@torch.no_grad()
def greedy_hf(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[:, prompt.shape[1]:]


def timed_pair(fn_a, fn_b, repeats):
    """Median wall time of each function, runs interleaved (a, b, a, b, ...) so that a change in
    machine load during the run hits both alike."""
    times, outs = ([], []), [None, None]
    for _ in range(repeats):
        for i, fn in enumerate((fn_a, fn_b)):
            t0 = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), outs[0], statistics.median(times[1]), outs[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        hf = transformers.LlamaForCausalLM.from_pretrained(d).eval()
        ours = Transformer.from_pretrained(d)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens
    greedy_ours(ours, prompt, 4), greedy_hf(hf, prompt, 4)                     # warm up both
    t_hf, out_hf, t_ours, out_ours = timed_pair(lambda: greedy_hf(hf, prompt, n),
                                                lambda: greedy_ours(ours, prompt, n), args.repeats)
    result = {
        "params_millions": round(ours.num_params() / 1e6, 1),
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": n, "threads": args.threads,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "ours_tokens_per_s": round(args.batch * n / t_ours, 1),
        "transformers_tokens_per_s": round(args.batch * n / t_hf, 1),
        "ratio_ours_over_transformers": round(t_hf / t_ours, 2),
        "identical_outputs": bool(torch.equal(out_ours, out_hf)),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()
