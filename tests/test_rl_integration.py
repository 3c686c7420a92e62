"""liger_dispatch.integrations.rl against TRL 1.16 on a tiny Llama built from a config (skipped without trl): TRL's
own GRPOTrainer._compute_loss, run once with TRL's fused LM head and once with the documented subclass's
_get_per_token_logps_and_entropies (our op), gives the same loss and gradients for each loss type; our grpo_loss
gives TRL's number; the sigmoid DPO loss is TRL's formula over TRL's per-token log-probs."""

from __future__ import annotations

import contextlib
import copy
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from liger_dispatch.integrations import rl  # noqa: E402

from kernel_checks import assert_rel_close  # noqa: E402

B, PROMPT, COMPLETION, VOCAB, TEMPERATURE = 3, 4, 6, 128, 0.9


class FusedGRPOTrainer(GRPOTrainer):
    """The subclass of liger_dispatch/integrations/rl.py's docstring."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        logps, entropy = rl.per_token_logps_and_entropy(model, input_ids, attention_mask, logits_to_keep,
                                                        temperature=self.temperature)
        return logps, (entropy if compute_entropy else None), None


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).float()


def trainer_state(cls, loss_type, beta):
    """What GRPOTrainer._compute_loss reads of its trainer, for one process and no accumulation."""
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext, gather=lambda x: x,
                                        gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x,
                                        num_processes=1, sync_gradients=True, is_main_process=True)
    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    state = dict(accelerator=accelerator, args=args, temperature=TEMPERATURE, top_entropy_quantile=1.0,
                 aux_loss_enabled=False, off_policy_mask_threshold=None, importance_sampling_level="token",
                 beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False,
                 model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
                 max_completion_length=COMPLETION, _entropy_bonus_enabled=False,
                 _metrics=defaultdict(lambda: defaultdict(list)))
    fake = type("Trainer", (), {"_compute_loss": GRPOTrainer._compute_loss,
                                "_get_per_token_logps_and_entropies": cls._get_per_token_logps_and_entropies})()
    fake.__dict__.update(state)
    return fake


def batch():
    torch.manual_seed(1)
    completion_mask = torch.ones(B, COMPLETION, dtype=torch.long)
    completion_mask[0, -2:] = 0  # a completion that ended early
    completion_mask[2, -1:] = 0
    prompt_mask = torch.ones(B, PROMPT, dtype=torch.long)
    prompt_mask[1, 0] = 0  # a left-padded prompt
    return dict(prompt_ids=torch.randint(0, VOCAB, (B, PROMPT)), prompt_mask=prompt_mask,
                completion_ids=torch.randint(0, VOCAB, (B, COMPLETION)), completion_mask=completion_mask,
                advantages=torch.randn(B), num_items_in_batch=completion_mask.sum().float())


def with_old_and_ref(inputs, model):
    """Old and reference log-probs near the policy's (so some ratios are clipped): TRL's own, perturbed."""
    fake = trainer_state(GRPOTrainer, "dapo", 0.0)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps = fake._get_per_token_logps_and_entropies(model, ids, mask, COMPLETION)[0]
    return dict(inputs, old_per_token_logps=logps + 0.3 * torch.randn_like(logps),
                ref_per_token_logps=logps + 0.1 * torch.randn_like(logps))


@pytest.fixture(scope="module")
def models():
    ours = tiny_llama()
    theirs = copy.deepcopy(ours)
    add_fused_lm_head(theirs, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return ours, theirs


def test_per_token_logps_and_entropy_are_trls(models):
    ours, theirs = models
    inputs = batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    want_lp, want_ent, _ = trainer_state(GRPOTrainer, "dapo", 0.0)._get_per_token_logps_and_entropies(
        theirs, ids, mask, COMPLETION, compute_entropy=True)
    got_lp, got_ent = rl.per_token_logps_and_entropy(ours, ids, mask, COMPLETION, temperature=TEMPERATURE)
    kept = inputs["completion_mask"].bool()
    assert_rel_close("logps", got_lp[kept], want_lp[kept], 1e-5)
    assert_rel_close("entropy", got_ent[kept], want_ent[kept], 1e-5)
    assert (got_lp[~kept] == 0).all() and (got_ent[~kept] == 0).all()


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04), ("bnpo", 0.0), ("dr_grpo", 0.04)])
def test_grpo_step_through_the_op_is_trls(models, loss_type, beta):
    """TRL's _compute_loss on its own fused head and on the subclass's: the same loss and parameter gradients; and
    rl.grpo_loss over the same per-token log-probs is TRL's loss."""
    ours, theirs = models
    inputs = with_old_and_ref(batch(), theirs)
    results = []
    for cls, model in ((GRPOTrainer, theirs), (FusedGRPOTrainer, ours)):
        model.zero_grad()
        loss = trainer_state(cls, loss_type, beta)._compute_loss(model, inputs)
        loss.backward()
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    assert_rel_close(f"{loss_type} loss", got, want, 1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        assert_rel_close(f"{loss_type} grad of {name}", got_grads[name], want_grads[name], 1e-4)

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, _ = rl.per_token_logps_and_entropy(ours, ids, mask, COMPLETION, temperature=TEMPERATURE)
    mine = rl.grpo_loss(logps, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"],
                        ref_per_token_logps=inputs["ref_per_token_logps"], beta=beta, epsilon=0.2, epsilon_high=0.28,
                        loss_type=loss_type, max_completion_length=COMPLETION,
                        num_items_in_batch=inputs["num_items_in_batch"])
    assert_rel_close(f"{loss_type} rl.grpo_loss", mine, want, 1e-5)


def test_dpo_sigmoid_is_trls(models):
    """TRL 1.16's sigmoid DPO (dpo_trainer.py: -logsigmoid(beta * delta_score), mean) over its fused head's summed
    completion log-probs, against rl.dpo_sigmoid_loss over ours; gradients of the policy too."""
    ours, theirs = models
    inputs = batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    pairs = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])  # [chosen; rejected]
    completion = pairs[1][:, -COMPLETION:]
    ref = torch.randn(2 * B) - 8.0
    beta = 0.1
    results = []
    for model, logps_of in (
            (theirs, lambda: trainer_state(GRPOTrainer, "dapo", 0.0)._get_per_token_logps_and_entropies(
                theirs, *pairs, COMPLETION)[0]),
            (ours, lambda: rl.per_token_logps_and_entropy(ours, *pairs, COMPLETION, temperature=TEMPERATURE)[0])):
        model.zero_grad()
        sequence = rl.sequence_logps(logps_of(), completion)
        chosen, rejected = sequence.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        if model is theirs:
            delta_score = (chosen - ref_chosen) - (rejected - ref_rejected)
            loss = (-F.logsigmoid(beta * delta_score)).mean()
        else:
            loss = rl.dpo_sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta)
        loss.backward()
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
    assert_rel_close("dpo loss", results[1][0], results[0][0], 1e-5)
    for got, want in zip(results[1][1], results[0][1]):
        assert_rel_close("dpo grad", got, want, 1e-4)
    smoothed = rl.dpo_sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta, label_smoothing=0.1)
    d = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    assert_rel_close("cdpo", smoothed, (-(0.9 * F.logsigmoid(d)) - 0.1 * F.logsigmoid(-d)).mean(), 1e-6)
