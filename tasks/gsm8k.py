r"""GSM8K scored as lm-evaluation-harness's `gsm8k_cot` scores it: the code of
`finetune_hf.py eval`, a sweep of one model over static k and ConfAdapt
thresholds (and the lossless mode) that writes results.md, results.json,
pareto.png and samples.jsonl. What the lessons are measured with, not part of the
method: a learner can skip it.

Prompt: Wei et al.'s (2022) 8 exemplars "Q: ...\nA: ... The answer is N.", then
"Q: {question}\nA:".
  strict-match      the FIRST match of `The answer is (\-?[0-9\.\,]+).` -- the last "." is
                    an unescaped regex dot (ANY one character), so with nothing after the
                    number the group gives back its last digit: a final "The answer is 42"
                    gives "4";
  flexible-extract  the LAST match of `(-?[$0-9.,]{2,})|(-?[0-9]+)`, the last number-like
                    run.
Before comparing, extraction and gold answer (the text after "####") lose every ","
and "$", all up to "#### " and one trailing ".", and are lower-cased. Standard error:
sqrt(sample var / n).
"""

import json
import math
import re
import statistics
import sys
from pathlib import Path

from confadapt import DecodeConfig, decode_modes
from mtp.tokenizer import prompt_tokens, start_tokens, Tokenizer
from tasks.word_problems import PROMPTS
from mtp.engine import generate
from mtp.hf import write_json, write_text
from mtp.cli import (Progress, compute_dtype, exactness, format_seconds, provenance,
                     read_rows)
from mtp.finetune_cli import load_for_inference, model_name

GSM8K_EXEMPLARS = json.loads((PROMPTS / "gsm8k_cot_exemplars.json").read_text("utf-8"))
GSM8K_STOP_STRINGS = ("Q:", "</s>", "<|im_end|>")
STRICT_MATCH = re.compile(r"The answer is (\-?[0-9\.\,]+).")
FLEXIBLE_EXTRACT = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED_BEFORE_COMPARING = (",", r"\$", r"(?s).*#### ", r"\.$")


def fewshot_prompt(question: str, n_shot: int = 8) -> str:
    shots = [f"Q: {e['question']}\nA: {e['answer']}" for e in GSM8K_EXEMPLARS[:n_shot]]
    return "\n\n".join(shots + [f"Q: {question}\nA:"])


def score(completion: str, gold: str) -> dict:
    def extract(regex, select):
        # Match `select` (0: first, -1: last); of its groups, the non-empty one.
        found = [m if isinstance(m, str) else next(g for g in m if g)
                 for m in regex.findall(completion)]
        return found[select].strip() if found else "[invalid]"

    def normalize(answer):
        for pattern in IGNORED_BEFORE_COMPARING:
            answer = re.sub(pattern, "", answer)
        return answer.lower()

    strict = extract(STRICT_MATCH, 0)
    flexible = extract(FLEXIBLE_EXTRACT, -1)
    return {"strict": strict, "flexible": flexible,
            "strict_ok": normalize(strict) == normalize(gold),
            "flexible_ok": normalize(flexible) == normalize(gold)}


def mean_and_stderr(values):
    """(mean, standard error of the mean)."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, statistics.stdev(values) / math.sqrt(len(values))


def completion_of(tok: Tokenizer, gen, stop_ids):
    """(text, tokens, forward passes) as if decoding had stopped at the first
    stop string: generate stops at stop TOKENS only, so a stop STRING ("Q:")
    ends the text with the pass that completed it."""
    tokens = gen.tokens
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    text = tok.decode(tokens)
    # Up to the first stop string, made by the first pass whose text has it.
    cut = min((text.split(s)[0] for s in GSM8K_STOP_STRINGS), key=len)
    if cut != text:
        for passes, end in enumerate(gen.boundaries, 1):
            if any(s in tok.decode(gen.tokens[:end]) for s in GSM8K_STOP_STRINGS):
                return cut, end, passes
    return cut, len(gen.tokens), gen.forward_passes


def evaluate(args) -> list[dict]:
    modes = decode_modes(static_ks=args.static_k, taus=args.taus, k_max=args.k_max,
                         lossless_k=args.lossless_k)
    if not modes:
        raise ValueError("nothing to evaluate: give --static-k and/or --taus")
    model, tok, mask_id, fmt, stop_ids = load_for_inference(args)
    questions = read_rows(args.data, [("question", "answer")])[: args.limit or None]

    # Checked before any decoding, not after the first decoder.
    need_mask = list(dict.fromkeys(m.kind for m in modes if m.block > 1))
    if need_mask and mask_id is None:
        raise ValueError(f"{args.model} has no <mask> token, which {' and '.join(need_mask)} "
                         "decoding needs: evaluate it with --static-k 1 --taus (greedy only), "
                         "or tune it first")

    # 1. Prompts; gold answers: the text after the last "####".
    golds = [answer.split("####")[-1].strip() for _, answer in questions]
    fewshot = args.prompt_style == "fewshot"
    name = model_name(args.model)
    if fewshot:
        title = f"{name}: GSM8K chain of thought, {args.n_shot}-shot"
        prompts = [start_tokens(tok, fmt) + tok.encode(fewshot_prompt(q, args.n_shot))
                   for q, _ in questions]
    else:
        title = f"{name}: GSM-style questions, zero-shot ({fmt} format)"
        prompts = [prompt_tokens(tok, fmt, q) for q, _ in questions]

    # An earlier eval's k=1 completions (the untuned model's), and which were right.
    reference = None
    greedy = None
    reference_ok = None
    if args.reference:
        path = Path(args.reference) / "samples.jsonl"
        greedy = [r for r in read_rows(path) if r.get("decoding") == "k=1 (greedy)"]
        if len(greedy) < len(golds):
            raise ValueError(f"{path}: {len(greedy)} greedy (k=1) completions, {len(golds)} "
                             "needed; run that eval with --static-k 1")
        if any("flexible_ok" not in r for r in greedy):
            raise ValueError(f"{path}: a k=1 row without flexible_ok; is it an eval's samples?")
        greedy.sort(key=lambda r: r["index"])
        reference = [r["completion"] for r in greedy][:len(golds)]
        reference_ok = [r["flexible_ok"] for r in greedy][:len(golds)]

    # 2. Where the results go, and the table's head.
    meta = {"model": args.model, "data": args.data, "prompt_style": args.prompt_style,
            "format": fmt, "n_shot": args.n_shot if fewshot else 0,
            "max_new_tokens": args.max_new_tokens,
            **provenance(compute_dtype(model), next(model.parameters()).device)}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    same = reference is not None
    columns = ("decoding | flexible-extract acc. | strict-match acc. | "
               "effective k (mean ± std) | tokens/s")
    against = " same as reference | won / lost | paired difference |"
    header = [f"| {columns} |" + (against if same else ""),
              "|---|---|---|---|---|" + "---|---|---|" * same]
    print(f"### {title}", *header, sep="\n", flush=True)

    # 3. Each decoder over all prompts, longest first; table: results.md's rows.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    ordered = [prompts[i] for i in order]
    results = []
    table = []
    samples_text = []
    # per decoder, per question: flexible-extract correct?
    correct = {}
    try:
        for mode in modes:
            gens, seconds = decode_with_progress(model, ordered, mode, mask_id, stop_ids, args)
            samples = [None] * len(order)
            for i, gen in zip(order, gens):
                text, n_tokens, passes = completion_of(tok, gen, stop_ids)
                samples[i] = {"index": i, "completion": text, "gold": golds[i],
                              "tokens": n_tokens, "passes": passes,
                              "effective_k": n_tokens / max(1, passes),
                              **score(text, golds[i])}

            row = result_row(mode, samples, seconds, args.batch_size)
            correct[row["decoding"]] = [s["flexible_ok"] for s in samples]
            # How often the answer is the reference's, word for word, and which is right
            # more often, question by question.
            if same:
                row["same_as_reference"] = mean_and_stderr(
                    s["completion"] == r for s, r in zip(samples, reference))[0]
                row["vs_reference"] = paired_difference(correct[row["decoding"]], reference_ok)
            results.append(row)
            table.append(table_line(row))
            print(table[-1], flush=True)
            samples_text += [json.dumps({"decoding": row["decoding"], **s}) + "\n"
                             for s in samples]

            # Written after each decoder: an interrupted eval keeps those done.
            write_eval(out, title, meta, header, table, results, samples_text)
    except KeyboardInterrupt:
        kept = "nothing written"
        if results:
            kept = f"{out} holds the results of the {len(results)} finished decoder(s)"
        raise KeyboardInterrupt(kept) from None
    if args.tolerance is not None:
        base = correct.get("k=1 (greedy)")
        baseline = "this model's k=1"
        if greedy is not None:
            base = [r["flexible_ok"] for r in greedy][:len(golds)]
            baseline = f"k=1 of {args.reference}"
        spot = sweet_spot(results, correct, base, args.tolerance, baseline)
        print(spot["summary"])
        write_eval(out, title, meta, header, table, results, samples_text, spot)
    print(f"wrote {out / 'results.md'}, results.json, pareto.png, samples.jsonl")
    return results


def paired_difference(ours, theirs) -> dict:
    """Two decoders' answers to the same questions (lists of correct?), compared question by
    question: won (right in ours, wrong in theirs), lost (the reverse), and the mean of ours -
    theirs (the difference in accuracy) with its standard error."""
    diffs = [int(a) - int(b) for a, b in zip(ours, theirs)]
    mean, se = mean_and_stderr(diffs)
    return {"won": diffs.count(1), "lost": diffs.count(-1), "difference": mean,
            "difference_se": se}


def sweet_spot(results, correct, base, tolerance, baseline) -> dict:
    """The ConfAdapt tau with the most tokens per pass whose flexible-extract accuracy
    is within `tolerance` points of `base`'s (per question: correct?), compared
    question by question: its drop, mean(base - tau) over the N questions, plus two
    standard errors of that mean, is at most the tolerance. None qualifies where the
    tolerance is inside the noise (under two standard errors of every tau's drop)."""
    taus = []
    for row in results:
        if row["kind"] != "confadapt":
            continue
        paired = paired_difference(base, correct[row["decoding"]])
        drop, se = paired["difference"], paired["difference_se"]
        taus.append({"tau": row["tau"], "k_max": row["k_max"],
                     "effective_k": row["effective_k_overall"],
                     "drop_points": 100 * drop, "stderr_points": 100 * se,
                     "within": 100 * (drop + 2 * se) <= tolerance})
    inside = [t for t in taus if t["within"]]
    best = max(inside, key=lambda t: t["effective_k"], default=None)
    head = (f"tolerance {tolerance:g} points below {baseline} (flexible-extract, "
            f"paired over N = {len(base)} questions): ")
    if best is None:
        summary = head + "none (no tau's drop + 2 standard errors is within it)"
    else:
        summary = (head + f"tau {best['tau']:g} ({best['effective_k']:.2f} tokens per "
                   f"pass; drop {best['drop_points']:.1f} ± {best['stderr_points']:.1f})")
    return {"tolerance_points": tolerance, "baseline": baseline, "n": len(base),
            "taus": taus, "best_tau": best and best["tau"], "summary": summary}


def result_row(mode: DecodeConfig, samples, seconds, batch_size) -> dict:
    """One decoder's results: accuracies with standard errors, effective k,
    tokens/s."""
    flex, flex_se = mean_and_stderr(s["flexible_ok"] for s in samples)
    strict, strict_se = mean_and_stderr(s["strict_ok"] for s in samples)
    eff = [s["effective_k"] for s in samples]
    tokens = sum(s["tokens"] for s in samples)
    passes = sum(s["passes"] for s in samples)

    # greedy is static k = 1; its rows keep the name and kind results files have always had
    greedy = mode.describe() == "greedy"
    decoding = "k=1 (greedy)" if greedy else mode.describe()
    kind = "greedy" if greedy else mode.kind
    # ConfAdapt has a threshold and a k_max instead of one k.
    row = {"decoding": decoding, "kind": kind, "k": mode.block, "tau": None, "k_max": None}
    if mode.kind == "confadapt":
        row.update(k=None, tau=mode.tau, k_max=mode.k_max)

    return {**row, "n": len(samples), "flexible_acc": flex, "flexible_se": flex_se,
            "strict_acc": strict, "strict_se": strict_se,
            "effective_k_mean": statistics.mean(eff),
            "effective_k_std": statistics.pstdev(eff),
            "effective_k_overall": tokens / max(1, passes),
            "tokens_per_second": tokens / max(seconds, 1e-9), "batch_size": batch_size}


def table_line(row):
    """results.md's line of one decoder: accuracies in % ± standard error."""
    line = (f"| {row['decoding']}{exactness(row['decoding'])} "
            f"| {100 * row['flexible_acc']:.1f} ± {100 * row['flexible_se']:.1f} "
            f"| {100 * row['strict_acc']:.1f} ± {100 * row['strict_se']:.1f} "
            f"| {row['effective_k_mean']:.2f} ± {row['effective_k_std']:.2f} "
            f"| {row['tokens_per_second']:,.1f} |")
    if "same_as_reference" in row:
        line += f" {100 * row['same_as_reference']:.0f}% |"
    if "vs_reference" in row:
        paired = row["vs_reference"]
        line += (f" {paired['won']} / {paired['lost']} | {100 * paired['difference']:+.1f} "
                 f"± {100 * paired['difference_se']:.1f} |")
    return line


def decode_with_progress(model, prompts, mode: DecodeConfig, mask_id, stop_ids, args):
    """generate() in parts of 4 batches, a progress line between them ->
    (generations, decoding seconds, prefill excluded). A part's last passes run
    with a partly empty batch, so tokens/s is a little under one continuous
    generate() over all prompts."""
    part = 4 * args.batch_size
    gens = []
    seconds = 0.0
    progress = Progress()
    for first in range(0, len(prompts), part):
        done, stats = generate(model, prompts[first:first + part], args.max_new_tokens,
                               mode=mode, mask_id=mask_id, stop_ids=stop_ids,
                               batch_size=args.batch_size)
        gens += done
        seconds += stats.seconds - stats.prefill_seconds
        if len(gens) < len(prompts) and progress.due():
            print(f"  {mode.describe()}: {len(gens)}/{len(prompts)} answers, "
                  f"{format_seconds(seconds)}", file=sys.stderr, flush=True)
    return gens, seconds


def write_eval(out, title, meta, header, table, results, samples_text, spot=None):
    report = {"meta": meta, "results": results}
    if spot is not None:
        report["sweet_spot"] = spot
    write_json(out / "results.json", report)
    md = [f"### {title}", "", *header, *table]
    # Every row has the question count, the batch size and, with --reference, the share.
    row = results[0]
    note = (f"n = {row['n']} questions; accuracy in % ± standard error; effective k = tokens / "
            "forward passes per completion (not a wall-clock speed-up); tokens/s = decoding "
            f"throughput at batch size {row['batch_size']}, prefill excluded")
    if "same_as_reference" in row:
        note += ("; same as reference = share of answers identical to the reference's k=1 "
                 "answer; won / lost = questions this decoder gets right and the reference's "
                 "k=1 wrong, and the reverse; paired difference = this accuracy minus the "
                 "reference's, in points, question by question, ± its standard error")
    md += ["", note + ".", ""]
    if spot is not None:
        md += [spot["summary"] + ".", ""]
    write_text(out / "results.md", "\n".join(md))
    write_text(out / "samples.jsonl", "".join(samples_text))
    pareto_plot(results, out / "pareto.png", title)


def pareto_plot(rows, path, title):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot(xlabel="effective k (tokens per forward pass)",
                         ylabel="accuracy, flexible-extract (%)")
    for name, kinds, marker, label in [("static k", ("greedy", "static"), "o", "k={k}"),
                                       ("ConfAdapt", ("confadapt",), "s", "τ={tau:g}"),
                                       ("lossless", ("lossless",), "D", "k≤{k}")]:
        pts = sorted((r for r in rows if r["kind"] in kinds),
                     key=lambda r: r["effective_k_mean"])
        x = [r["effective_k_mean"] for r in pts]
        y = [100 * r["flexible_acc"] for r in pts]
        if pts:
            ax.errorbar(x, y, yerr=[100 * r["flexible_se"] for r in pts], marker=marker,
                        capsize=3, label=name)
        for r, p in zip(pts, zip(x, y)):
            ax.annotate(label.format(**r), p, xytext=(4, 4), textcoords="offset points",
                        fontsize=7)
    # The Pareto front: points no other point matches or beats on both axes.
    points = [(r["effective_k_mean"], 100 * r["flexible_acc"]) for r in rows]
    front = sorted(p for p in set(points)
                   if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points))
    ax.plot([x for x, _ in front], [y for _, y in front], "k--", lw=0.8, alpha=0.5,
            label="Pareto front")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
