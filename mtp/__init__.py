"""What the lessons use but do not teach: command-line plumbing, the continuous-batching
decoding engine, Hugging Face checkpoint and tokenizer files, distributed training, plots.

A learner can skip this package: the top-level files are the method."""
