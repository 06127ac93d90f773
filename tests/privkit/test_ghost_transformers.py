"""HF transformers' models under ghost clipping, as a user builds them, against per-example
gradients.

Every family of ``benchmarks/hf_models.py`` that ghost clipping takes, at a small size with no
pretrained weights, goes through ``DpSgdStep`` without fallback, and its clipped sum equals the
per-example gradients clipped (float64; ``torch.func``'s, or for BART, whose boolean pooling
``torch.func`` cannot batch, a loop's). Among them: GPT-2 (``Conv1D`` maps, its head tied to the
token embedding, ``(1, T)`` position ids), BERT (position and token-type ids shared by the
batch), Llama, Mistral, Qwen2 (their own RMSNorm, rotary positions, grouped-query attention),
OPT (offset positions by an embedding subclass, its MLP on ``(B T, d)`` rows), Gemma (scaled word
embeddings by a subclass, tied to the head), BART (one scaled table for encoder, decoder and
head), ViT and DeiT (class and distillation tokens, position embeddings), ConvNeXt (its
LayerNorm subclass on permuted channels, a channels-last layer scale), T5 (a relative-position
table read on ``(T, T)`` positions, permuted and passed to attention as its mask, and its
RMSNorm's bare weights) and Swin (a bias table indexed by positions, added to every window's
scores): the last two followed to where they meet the batch
(``privkit.mechanisms.ghost_broadcast``), and ResNet in eval mode (its BatchNorm layers, on their
running statistics, by ``torch.func`` on each layer alone: ``privkit.mechanisms.ghost_layer_vjp``);
in training mode its BatchNorm mixes the batch's examples and it is refused, with the reason. In
training mode, where
``torch.func`` cannot draw dropout, GPT-2's sum with clipping off is the plain backward pass' for
the same random draws. GPT-2's DP-SGD is audited white-box.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from privkit.mechanisms import dp_sgd_step, ghost_clipping
from tests.privkit.test_ghost_parameters import takes_ghost_clipping

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from hf_models import CAUSAL, Logits, batch, build, example_losses, looped, record_loss

V = 50
TAKEN = (
    "gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neo", "opt", "bert", "roberta",
    "electra", "albert", "distilbert", "bart", "vit", "deit", "convnext", "t5", "swin", "resnet",
)  # fmt: skip
#: refused in training mode (a BatchNorm there mixes the batch's examples)
REFUSED = {"resnet": "BatchNorm2d in training mode"}


def _model(family: str):
    """The family's small model in float64, 6 examples and their targets (classes, or for a
    causal model the sequence itself, whose first token is 3, 4, 5, 3, 4, 5), and its kind."""
    torch.manual_seed(50)
    model, kind = build(family, vocab=V)
    x, y = batch(kind, 6, V, 12)
    if kind == CAUSAL:
        x[:, 0] = 3 + torch.arange(6) % 3
    else:
        y = torch.arange(6) % 3
    return Logits(model, kind).double(), (x.double() if x.is_floating_point() else x), y, kind


def _spread(loss):
    """A record's loss times 1, 2 or 3 by its target (its first token): the examples' gradient
    norms in three groups, so that a clip norm between two of them clips some and not others."""

    def spread(logits, y, aux):
        return loss(logits, y, aux) * (1 + y.reshape(-1)[0] % 3)

    return spread


@pytest.mark.parametrize("family", TAKEN)
def test_hf_models_take_ghost_clipping(family, monkeypatch):
    model, x, y, kind = _model(family)
    if family == "bart":  # torch.func cannot batch its end-of-sequence pooling
        with pytest.raises(RuntimeError, match="vmap"):
            dp_sgd_step.per_sample_gradients(model, x, y, record_loss(kind))
        monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", looped)
    takes_ghost_clipping(model, x, y, monkeypatch, _spread(record_loss(kind)))


@pytest.mark.parametrize("family", REFUSED)
def test_hf_models_ghost_clipping_refuses(family):
    """In training mode (``torch.func`` cannot clip it either: a BatchNorm's running statistics
    are updated in place within its transform)."""
    from privkit.mechanisms.stacked import UnsupportedModelError

    model, x, y, kind = _model(family)
    model.train()
    with pytest.raises(UnsupportedModelError, match=REFUSED[family]):
        ghost_clipping.clipped_sum(model, x, example_losses(kind, y), 1.0)


def test_gpt2_with_dropout_clipping_off_is_the_plain_pass():
    model, ids, _, kind = _model("gpt2")
    model.train()  # dropout 0.1 in the attention, the residuals and the embeddings

    losses = example_losses(kind, ids)
    torch.manual_seed(52)
    got = ghost_clipping.clipped_sum(model, ids, losses, math.inf)
    torch.manual_seed(52)
    losses(model(ids), slice(None)).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-10, atol=1e-12, msg=k)


def gpt2_predicting_the_last_token():
    """GPT-2 (small, no dropout) as a classifier of each sequence's next token."""
    model, _ = build("gpt2", vocab=V)
    return Logits(model, CAUSAL, last=True)


def test_a_gpt2_dp_sgd_audit_sees_its_bugs(monkeypatch):
    """GPT-2 predicting each sequence's next token, its DP-SGD audited white-box with canaries
    on every parameter: as claimed not a violation; half the noise, clipping off caught."""
    from tests.privkit.test_ghost_attention import audit_sees_its_bugs

    def build_audited():
        data = torch.randint(0, V, (400, 10)), torch.randint(0, V, (400,))
        return gpt2_predicting_the_last_token(), data

    audit_sees_its_bugs(monkeypatch, build_audited)


@pytest.mark.parametrize(
    "family, targets", [("gpt2", ["c_attn", "c_proj"]), ("llama", ["q_proj", "v_proj"])]
)
def test_lora_adapters_by_peft_take_ghost_clipping(family, targets, monkeypatch):
    """DP fine-tuning by LoRA (PEFT's adapters, the base model frozen): only the adapters'
    ``nn.Linear`` maps train, GPT-2's frozen ``Conv1D`` maps under them."""
    peft = pytest.importorskip("peft")
    model, x, y, kind = _model(family)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=family == "gpt2"
    )
    model.model = peft.get_peft_model(model.model, config)
    model = model.double()
    trainable = [k for k, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in k for k in trainable)
    takes_ghost_clipping(model, x, y, monkeypatch, _spread(record_loss(kind)))
