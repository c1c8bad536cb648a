"""The base model of the miniature GSM8K: word problems -> a next-token model, from scratch.

    python scripts/word_problem_base.py --out runs/wp          as in results/wordproblems/
    python scripts/word_problem_base.py --out runs/wp --quick   smoke test (seconds)

1. data: the synthetic word problems of tasks/word_problems.py, DIR/data/train.json
   (MetaMathQA format) and DIR/data/test.jsonl (GSM8K format)
2. training: a small Llama-style transformer learns the "plain" rows of finetune_hf.py
   (question, blank line, solution) by next-token prediction: train_toy.py's loop for its
   teacher (train_phase), the same loss, schedule and optimizer
3. DIR/base: the model and its tokenizer in Hugging Face layout, ready for
   `finetune_hf.py train --model DIR/base`

A second run into the same DIR is refused, unless --restart: then it trains again.
"""
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp.cli import (CUDNN_ATTENTION, CliError, Parser, add_flags,  # noqa: E402
                     apply_attention_backend, count, format_seconds, output_folder,
                     parse_device, positive_int, read_rows, run_cli)
from model import ModelConfig, Transformer  # noqa: E402
from tasks.word_problems import (word_problem_batch, word_problem_tokenizer,  # noqa: E402
                                 write_word_problems)
from mtp.hf import save_pretrained  # noqa: E402
from train_toy import train_phase  # noqa: E402


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

    # next-token training (train_toy.train_phase's names: this model is the teacher of
    # later tuning)
    batch_size: int = 32
    teacher_steps: int = 1500
    teacher_lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0


# --quick: a tiny model for a few steps on a little data
QUICK = dict(n_train=200, n_test=10, dim=32, n_layers=1, n_heads=2, ffn_dim=64,
             batch_size=4, teacher_steps=3, warmup_steps=1)


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
    # AdamW on next-token cross-entropy over the question and solution of random rows
    model, _ = train_phase("base", Transformer(config).to(device), cfg, device=device,
                           next_batch=lambda rng, size: word_problem_batch(
                               tokenizer, pairs, rng, size, seq_len=cfg.seq_len))

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
    add_flags(p, CUDNN_ATTENTION)
    args = p.parse_args(argv)

    preset = QUICK if args.quick else {}
    cfg = BaseConfig(seed=args.seed, **preset)
    device = parse_device(args.device)
    apply_attention_backend(args.cudnn_attention, device)
    torch.set_num_threads(args.threads)
    output_folder(args.out, "--out")
    return word_problem_base(args, cfg, device)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
