"""`finetune_hf.py analyze`: before tuning, is a domain predictable enough to be
worth it? An estimate from the base model's own confidences of the tokens per
forward pass ConfAdapt could reach; a learner can skip it.

The base model answers the domain's prompts greedily; c_t is each answer token's
top-1 probability given the true prefix. ConfAdapt accepts a mask prediction when
the TUNED model is at least tau sure of it without seeing the tokens just before.
Two bounds on that:
  per-token (optimistic)  prediction j of a pass is accepted while every c it covers
                          is >= tau;
  joint (conservative)    accepted while c_t * c_{t+1} * ... * c_{t+j} >= tau: the
                          probability of the whole greedy run, a lower bound on the
                          marginal of its last token.
Both read the UNTUNED model's confidences, and tuning sharpens them: the hard
teacher's targets are the model's own argmax predictions, one-hot, which the
student learns to make at mask positions with growing confidence. Read them as a
floor of what tuning can give, not a forecast.

A gated mask adapter (adapter.py) is the exception: its first prediction of a pass
is the untuned model's own, so c_t is never sharpened. Its ceiling:
  gated (a ceiling)       a pass keeps k_max tokens where c_t >= tau (every mask
                          guess sure, and right), one elsewhere.
"""

import math
from pathlib import Path

import torch

from confadapt import DecodeConfig, accept_confadapt
from mtp.tokenizer import prompt_tokens
from tasks.word_problems import domain_prompts
from mtp.engine import generate
from mtp.hf import write_json, write_text
from mtp.cli import compute_dtype, provenance, read_rows
from mtp.finetune_cli import load_for_inference, model_name


def simulated_passes(conf: list[float], tau: float, k_max: int, joint: bool,
                     gated: bool = False) -> int:
    """Forward passes ConfAdapt(tau, k_max) needs for an answer with these
    confidences (per token or joint; gated: the first of a pass the model's own,
    every mask sure, a gated adapter's ceiling)."""
    t = 0
    passes = 0
    while t < len(conf):
        window = conf[t:t + k_max]
        if gated:
            window = window[:1] + [1.0] * (len(window) - 1)
        # Joint: c_t, c_t c_{t+1}, c_t c_{t+1} c_{t+2}, ...
        elif joint:
            window = [math.prod(window[:j + 1]) for j in range(len(window))]
        t += accept_confadapt(window, tau)
        passes += 1
    return passes


def analyze(args) -> dict:
    model, tok, _, fmt, stop_ids = load_for_inference(args)
    if args.domains:
        # Held-out prompts generated in code.
        groups = {domain: domain_prompts(domain, args.limit, "test")
                  for domain in args.domains}
    else:
        # GSM8K, MetaMathQA or generic rows.
        questions = read_rows(args.data, [("question",), ("query",), ("prompt",)])
        groups = {Path(args.data).name: [q for (q,) in questions][: args.limit or None]}

    device = next(model.parameters()).device
    reports = {}
    for name, questions in groups.items():
        prompts = [prompt_tokens(tok, fmt, q) for q in questions]
        gens, _ = generate(model, prompts, args.max_new_tokens, DecodeConfig("static", k=1),
                           stop_ids=stop_ids, batch_size=args.batch_size)
        # Per answer: the top-1 probability at each of its tokens, one
        # teacher-forced pass over prompt + answer.
        confs = []
        for prompt, gen in zip(prompts, gens):
            if not gen.tokens:
                continue
            with torch.inference_mode():
                ids = torch.tensor([prompt + gen.tokens], device=device)   # (1, P + A)
                index = torch.arange(len(prompt) - 1, ids.shape[1] - 1, device=ids.device)
                probs = model(ids, output_index=index[None]).float().softmax(-1)  # (1, A, V)
                confs.append(probs.max(-1).values[0].tolist())

        reports[name] = predictability(confs, args.taus, args.k_max)

    taus = " | ".join(f"tau {t:g}" for t in args.taus)
    md = [f"### Predictability for {model_name(args.model)}", "",
          f"Greedy answers (at most {min(args.max_new_tokens, model.config.max_seq_len)} "
          f"tokens) to held-out prompts, {fmt} format; "
          f"ConfAdapt k_max = {args.k_max}; effective k estimated from the model's own "
          "confidences (of an untuned model, a floor: tuning sharpens them), joint to per-token.",
          "",
          f"| prompts | answers | tokens | mean confidence | {taus} |",
          "|---|---|---|---|" + "---|" * len(args.taus)]
    for name, r in reports.items():
        ranges = " | ".join(f"{e['effective_k_joint']:.2f}-{e['effective_k_per_token']:.2f}"
                            for e in r["estimates"])
        md.append(f"| {name} | {r['answers']} | {r['tokens']} "
                  f"| {r['mean_confidence']:.3f} | {ranges} |")
    md += [""] + [f"- {name}: {r['verdict']}" for name, r in reports.items()]
    md += [f"- {name}: a gated adapter on this model keeps at most "
           + ", ".join(f"{e['effective_k_gated_ceiling']:.2f} at tau {e['tau']:g}"
                       for e in r["estimates"])
           + " (the model's own confidence gates each pass; every mask guess sure)"
           for name, r in reports.items()] + [""]

    print("\n".join(md))
    report = {"model": args.model, "format": fmt, "k_max": args.k_max,
              "max_new_tokens": args.max_new_tokens, "domains": reports,
              **provenance(compute_dtype(model), device)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "analysis.json", report)
        write_text(out / "analysis.md", "\n".join(md))
    return report


def predictability(confs, taus, k_max):
    """One domain's report: effective k both ways per tau, and a verdict at tau
    0.9."""
    flat = [c for cs in confs for c in cs]
    if not flat:
        raise ValueError("the model produced no answer tokens")

    def effective_k(tau: float, joint: bool, gated: bool = False) -> float:
        passes = sum(simulated_passes(cs, tau, k_max, joint, gated) for cs in confs)
        return len(flat) / passes

    rows = [{"tau": tau, "share_confident": sum(c >= tau for c in flat) / len(flat),
             "effective_k_per_token": effective_k(tau, joint=False),
             "effective_k_joint": effective_k(tau, joint=True),
             "effective_k_gated_ceiling": effective_k(tau, joint=False, gated=True)}
            for tau in taus]

    ref = min(rows, key=lambda r: abs(r["tau"] - 0.9))
    worth = ref["effective_k_per_token"] >= 2.0
    verdict = (f"at tau={ref['tau']:g} the model's own confidences already allow "
               f"about {ref['effective_k_joint']:.1f} (joint) to "
               f"{ref['effective_k_per_token']:.1f} (per token) tokens per pass; ")
    if worth:
        verdict += "predictable enough to be worth tuning."
    else:
        verdict += ("a floor: tuning sharpens confidences, so a tuned model can keep "
                    "more tokens per pass.")
    return {"answers": len(confs), "tokens": len(flat), "mean_confidence": sum(flat) / len(flat),
            "estimates": rows, "worth_tuning": worth, "verdict": verdict}
