"""The base model of the miniature GSM8K: word problems -> a next-token model, from scratch.

    python scripts/word_problem_base.py --out runs/wp          as in results/wordproblems/
    python scripts/word_problem_base.py --out runs/wp --quick   smoke test (seconds)

1. data: the synthetic word problems of tasks/word_problems.py, DIR/data/train.json
   (MetaMathQA format) and DIR/data/test.jsonl (GSM8K format)
2. training: a small Llama-style transformer learns the "plain" rows of finetune_hf.py
   (question, blank line, solution) by next-token prediction, one loop below
3. DIR/base: the model and its tokenizer in Hugging Face layout, ready for
   `finetune_hf.py train --model DIR/base`

A second run into the same DIR is refused, unless --restart: then it trains again.
"""
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp.cli import (CliError, Parser, Progress, count, format_seconds,  # noqa: E402
                 output_folder, parse_device, positive_int, read_rows, run_cli)
from model import ModelConfig, Transformer  # noqa: E402
from tasks.word_problems import (word_problem_batch, word_problem_tokenizer,  # noqa: E402
                                 write_word_problems)
from mtp.hf import save_pretrained  # noqa: E402


@dataclass
class BaseConfig:
    # the data
    n_train: int = 20_000
    n_test: int = 500
    # training rows: question and solution
    seq_len: int = 64

    # the model; it supports 512 positions: room for few-shot prompts
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 512
    context: int = 512

    # next-token training
    batch_size: int = 32
    steps: int = 1500
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0


# --quick: a tiny model for a few steps on a little data
QUICK = dict(n_train=200, n_test=10, dim=32, n_layers=1, n_heads=2, ffn_dim=64,
             batch_size=4, steps=3, warmup_steps=1)


def train(model: Transformer, cfg: BaseConfig, tokenizer, pairs: list, device):
    """AdamW on next-token cross-entropy over the question and solution of random rows."""
    opt = model.configure_optimizer(cfg.lr, cfg.weight_decay)
    rng = random.Random(cfg.seed + 1)
    print(f"  base: {model.num_params() / 1e6:.2f}M parameters, "
          f"{model.config.vocab_size} tokens")

    model.train()
    start = time.perf_counter()
    progress = Progress()
    for step in range(cfg.steps):
        # 1. the learning rate: linear warm-up, then cosine decay to 10% of the peak
        if step < cfg.warmup_steps:
            lr = cfg.lr * ((step + 1) / cfg.warmup_steps)
        else:
            decay = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            lr = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * decay)))
        for group in opt.param_groups:
            group["lr"] = lr

        # 2. the batch and its loss; -100 marks what is not trained (<bos>, padding)
        seqs, trained = word_problem_batch(tokenizer, pairs, rng, cfg.batch_size,
                                           seq_len=cfg.seq_len)
        seqs = seqs.to(device)                                         # (B, N)
        logits = model(seqs[:, :-1]).float()                           # (B, N-1, V)
        targets = seqs[:, 1:].masked_fill(~trained[:, 1:].to(device), -100)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                               ignore_index=-100)

        # 3. backward, clip, update
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        # 4. now and then a progress line, its ETA at the pace so far
        done = step + 1
        if progress.due(last=done == cfg.steps):
            elapsed = time.perf_counter() - start
            left = elapsed / done * (cfg.steps - done)
            print(f"[base] step {done:4d}/{cfg.steps} | loss {loss.item():.4f} | "
                  f"{done * seqs.numel() / elapsed:,.0f} tok/s | "
                  f"{format_seconds(elapsed)} | eta {format_seconds(left)}", flush=True)
    return model.eval()


def word_problem_base(args, cfg: BaseConfig, device) -> dict:
    """DIR/data, then DIR/base; a finished DIR/base is replaced only with --restart."""
    start = time.perf_counter()
    base = os.path.join(args.out, "base")
    if os.path.exists(base) and not args.restart:
        raise CliError(f"{base} exists: choose another --out, or add --restart to train "
                       f"again")

    # 1. the data
    train_file, test_file = write_word_problems(
        os.path.join(args.out, "data"), n_train=cfg.n_train, n_test=cfg.n_test,
        seed=cfg.seed)
    pairs = read_rows(train_file, [("query", "response")])
    print(f"wrote {train_file} ({len(pairs)} rows, MetaMathQA format) and {test_file} "
          f"(GSM8K format)")

    # 2. the model, from scratch
    tokenizer = word_problem_tokenizer()
    torch.manual_seed(cfg.seed)
    config = ModelConfig(
        vocab_size=tokenizer.n_vocab, dim=cfg.dim, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim,
        max_seq_len=cfg.context, tie_embeddings=False,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    model = train(Transformer(config).to(device), cfg, tokenizer, pairs, device)

    # 3. saved in Hugging Face layout, with the tokenizer
    save_pretrained(model, base)
    tokenizer.save_pretrained(base)
    seconds = time.perf_counter() - start
    print(f"== done in {format_seconds(seconds)}: {base} (Hugging Face layout); next: "
          f"python finetune_hf.py train --model {base} --data {train_file} ...")
    return {"base": base, "train": str(train_file), "test": str(test_file),
            "seconds": seconds}


def main(argv=None) -> dict:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the run folder: DIR/data, DIR/base")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps, little data (for tests; seconds)")
    p.add_argument("--seed", type=count, default=0, help="seed for data and weights")
    p.add_argument("--restart", action="store_true",
                   help="train again, replacing DIR/base")
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available), cpu, cuda or cuda:N; float32 on each")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)

    preset = QUICK if args.quick else {}
    cfg = BaseConfig(seed=args.seed, **preset)
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    output_folder(args.out, "--out")
    return word_problem_base(args, cfg, device)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
