"""HF transformers' models under ghost clipping, as a user builds them, against torch.func.

GPT-2 (``Conv1D`` maps, its head tied to the token embedding, ``(1, T)`` position ids), BERT (its
``(1, T)`` position ids and token-type ids expanded over the batch, a pooler and a classifier),
Llama (its own RMSNorm, rotary positions, grouped-query attention), OPT (learned positions by an
embedding subclass, its MLP on ``(B T, d)`` rows), Gemma (scaled word embeddings by a subclass,
tied to the head) and BART (one scaled table for encoder, decoder and head, a classifier on the
end-of-sequence token): ``DpSgdStep``'s clipped sums come from ghost clipping without fallback
and equal per-example gradients clipped (``torch.func``'s; for BART, whose boolean pooling
``torch.func`` cannot batch, a loop's), in float64, small configurations, no pretrained weights.
In training mode, where ``torch.func`` cannot draw dropout, GPT-2's sum with clipping off is the
plain backward pass' for the same random draws. GPT-2's DP-SGD is audited white-box.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_clipping
from tests.privkit.test_ghost_parameters import takes_ghost_clipping

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V, T = 50, 10


class Logits(nn.Module):
    """A HF model called on token ids, its logits out (what ``DpSgdStep`` takes)."""

    def __init__(self, model, last=False):
        super().__init__()
        self.model, self.last = model, last

    def forward(self, ids):
        logits = self.model(input_ids=ids).logits
        return logits[:, -1] if self.last else logits


def gpt2(dropout=0.0):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _next_token_loss(logits, y, _aux):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())


def _next_token_losses(y):
    def losses(logits, s):
        flat = F.cross_entropy(logits[:, :-1].transpose(1, 2), y[s][:, 1:], reduction="none")
        return flat.mean(1)

    return losses


def test_gpt2_takes_ghost_clipping(monkeypatch):
    torch.manual_seed(50)
    model = Logits(gpt2()).eval().double()
    ids = torch.randint(0, V, (6, T))
    takes_ghost_clipping(model, ids, ids, monkeypatch, _next_token_loss)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight


def test_gpt2_with_dropout_clipping_off_is_the_plain_pass():
    torch.manual_seed(51)
    model = Logits(gpt2(dropout=0.2)).train().double()
    ids = torch.randint(0, V, (6, T))
    torch.manual_seed(52)
    got = ghost_clipping.clipped_sum(model, ids, _next_token_losses(ids), math.inf)
    torch.manual_seed(52)
    _next_token_losses(ids)(model(ids), slice(None)).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-10, atol=1e-12, msg=k)


def test_bert_classifier_takes_ghost_clipping(monkeypatch):
    torch.manual_seed(53)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=V, max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    model = Logits(transformers.BertForSequenceClassification(config)).eval().double()
    ids, y = torch.randint(0, V, (6, T)), torch.randint(0, 3, (6,))
    takes_ghost_clipping(model, ids, y, monkeypatch)


def test_llama_takes_ghost_clipping(monkeypatch):
    torch.manual_seed(54)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=V, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = Logits(transformers.LlamaForCausalLM(config)).eval().double()
    ids = torch.randint(0, V, (6, T))
    takes_ghost_clipping(model, ids, ids, monkeypatch, _next_token_loss)


def test_a_gpt2_dp_sgd_audit_sees_its_bugs(monkeypatch):
    """GPT-2 predicting each sequence's next token, its DP-SGD audited white-box with canaries
    on every parameter: as claimed not a violation; half the noise, clipping off caught."""
    from tests.privkit.test_ghost_attention import audit_sees_its_bugs

    def build():
        data = torch.randint(0, V, (400, T)), torch.randint(0, V, (400,))
        return Logits(gpt2(), last=True).eval(), data

    audit_sees_its_bugs(monkeypatch, build)


def test_opt_takes_ghost_clipping(monkeypatch):
    torch.manual_seed(55)
    config = transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64, vocab_size=V,
        max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
        eos_token_id=2,
    )  # fmt: skip
    model = Logits(transformers.OPTForCausalLM(config)).eval().double()
    ids = torch.randint(3, V, (6, T))
    takes_ghost_clipping(model, ids, ids, monkeypatch, _next_token_loss)


def test_gemma_takes_ghost_clipping(monkeypatch):
    torch.manual_seed(56)
    config = transformers.GemmaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, vocab_size=V, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Logits(transformers.GemmaForCausalLM(config)).eval().double()
    ids = torch.randint(3, V, (6, T))
    takes_ghost_clipping(model, ids, ids, monkeypatch, _next_token_loss)


def _looped(model, x, y, loss_fn, aux=None):
    """Per-example gradients by a loop over the examples (plain autograd, one at a time)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = {k: [] for k in params}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(
            loss_fn(model(x[i : i + 1]), y[i : i + 1], None),
            list(params.values()),
            allow_unused=True,
        )
        for (k, p), g in zip(params.items(), grads, strict=True):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(v) for k, v in rows.items()}


def test_bart_takes_ghost_clipping_where_torch_func_cannot(monkeypatch):
    torch.manual_seed(57)
    config = transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
        max_position_embeddings=32, num_labels=3, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        scale_embedding=True,
    )  # fmt: skip
    model = Logits(transformers.BartForSequenceClassification(config)).eval().double()
    ids, y = torch.randint(3, V, (6, T)), torch.randint(0, 3, (6,))
    ids[:, -1] = 2  # the end-of-sequence token the classifier reads
    with pytest.raises(RuntimeError, match="vmap"):
        dp_sgd_step.per_sample_gradients(model, ids, y, _class_loss)
    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", _looped)
    takes_ghost_clipping(model, ids, y, monkeypatch)


def _class_loss(logits, y, _aux):
    return F.cross_entropy(logits, y)
