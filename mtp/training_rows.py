"""Training rows for finetune_hf.py: the `data` command, which writes a model's own
greedy answers to domain prompts as rows, and how `train` reads rows files into
(prompt, response) pairs and refuses rows that give nothing to predict. Plumbing
around the lesson: a learner can skip it.

The hard teacher uses data only as prefixes (its targets are its own predictions),
so the model's greedy answers to prompts of the target domains serve, from the
distribution ConfAdapt decodes.
"""

import json
from pathlib import Path

import torch

from confadapt import DecodeConfig
from mtp.tokenizer import end_token, padding_token, prompt_tokens
from tasks.word_problems import domain_prompts
from mtp.engine import generate
from mtp.hf import write_text
from mtp.cli import fields_of, read_rows
from mtp.finetune_cli import load_for_inference


def make_data(args):
    model, tok, _, fmt, stop_ids = load_for_inference(args)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for domain in args.domains:
        questions = domain_prompts(domain, args.per_domain, args.split)
        prompts = [prompt_tokens(tok, fmt, q) for q in questions]
        try:
            gens, stats = generate(model, prompts, args.max_new_tokens, DecodeConfig("static", k=1),
                                   stop_ids=stop_ids, batch_size=args.batch_size)
        except KeyboardInterrupt:
            kept = f"{out} not written"
            if rows:
                done = sorted({r["domain"] for r in rows})
                kept = f"{out} holds the {len(rows)} rows of {', '.join(done)}"
            raise KeyboardInterrupt(f"{kept}; {domain} and the domains after it were not "
                                    "made") from None

        for q, g in zip(questions, gens):
            finished = bool(g.tokens) and g.tokens[-1] in stop_ids
            answer = tok.decode(g.tokens[:-1] if finished else g.tokens)
            rows.append({"domain": domain, "prompt": q, "response": answer,
                         "finished": finished})
        cut = sum(not r["finished"] for r in rows if r["domain"] == domain)
        print(f"{domain}: {len(questions)} answers ({cut} cut at --max-new-tokens "
              f"{args.max_new_tokens}: marked unfinished, train skips them), "
              f"{sum(len(g.tokens) for g in gens):,} tokens, {stats.seconds:.0f} s",
              flush=True)

        # Written after each domain: Ctrl-C keeps them.
        write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


def training_pairs(args, dist):
    """(prompt, response) pairs of every --data file, without the rows `data`
    marked unfinished (answers cut at its --max-new-tokens: a cut answer would
    teach the model to stop mid-text)."""
    # MetaMathQA, or generic.
    fields = [("query", "response"), ("prompt", "response")]
    pairs = []
    unfinished = 0
    for path in args.data:
        rows = read_rows(path)
        finished = [row for row in rows if row.get("finished") is not False]
        unfinished += len(rows) - len(finished)
        if finished:
            pairs += fields_of(finished, path, fields)
    if unfinished:
        dist.log(f"skipped {unfinished:,} rows marked unfinished (answers cut at data's "
                 "--max-new-tokens)")
    if not pairs:
        raise ValueError(f"every row of {' '.join(args.data)} is marked unfinished: nothing "
                         "to train on")
    return pairs[: args.limit_rows or None]


def check_targets(seqs, trained: torch.Tensor | None, tok, args, dist):
    """Refuse data and settings that give nothing to predict; warn when many
    rows give nothing. A row's targets are the tokens it trains on (`trained`:
    the response's, with --response-only) that are text: not the first token,
    not padding, not the end of a turn."""
    end = end_token(tok, args.format)
    pad = padding_token(tok, args.format)
    text = (seqs != pad) & (seqs != end)
    text[:, 0] = False
    if trained is not None:
        text &= trained
    empty = ~text.any(1)
    if not empty.any():
        return
    if trained is None:
        why = "no row has a token to predict"
    else:
        # Rows whose prompt fills them whole.
        cut = (~trained).all(1)
        why = (f"{int((empty & cut).sum()):,} rows are cut by --seq-len {args.seq_len} "
               f"before their response starts and {int((empty & ~cut).sum()):,} have an "
               "empty response")
        if empty.all():
            why += " (--response-only trains on response tokens only)"
    if empty.all():
        raise ValueError(f"no training targets in {' '.join(args.data)}: {why}")
    if empty.float().mean() >= 0.1:
        dist.log(f"warning: {int(empty.sum()):,} of {len(seqs):,} rows give no target "
                 f"({why}): they only take places in the batches")
