"""Training drafts: corpora sampled from the target, distillation loops, checkpoints, measurement."""
