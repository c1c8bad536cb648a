"""What the lessons are taught with: the toy tasks, the synthetic word problems and domain
prompts, and GSM8K scoring."""
