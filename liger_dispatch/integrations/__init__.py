"""Integrations with training libraries. Each one is optional and imports its library only when used:

- `liger_dispatch.integrations.causal_lm`: Hugging Face's causal-LM loss from final hidden states (no logits).
- `liger_dispatch.integrations.distillation`: TRL's GKD losses (generalized JSD, KL) from hidden states.
- `liger_dispatch.integrations.rl`: per-token log-probs of an HF causal LM without logits, TRL's GRPO and DPO losses.
- `liger_dispatch.integrations.transformers`: `patch(model)` for Hugging Face causal LMs (the `transformers` extra).
"""
