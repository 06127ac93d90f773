"""``nn.MultiheadAttention`` under book-keeping ghost clipping (privkit.mechanisms.ghost_attention).

Its forward with the linear maps in the open gives ``nn.MultiheadAttention``'s own outputs and
attention weights (float64, every mask kind, ``need_weights`` both ways, ``add_zero_attn``,
separate key and value widths, train and eval); models built on it (the module alone in
self-attention, cross-attention and with distinct query, key and value;
``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``; frozen projections; each
sequence-first too) get ghost clipping's per-example norms and
clipped sums equal to ``torch.func``'s (``test_ghost_clipping._check``); what it does not cover is
refused and DP-SGD falls back to ``torch.func``.
"""

import itertools

import pytest
import torch
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_attention, ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, _loss, _reference, falls_back

E, HEADS, B, L, S = 8, 2, 5, 6, 4

CAUSAL = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)


def _padding(x):
    """Each example's padded keys (from its own values: a mask per example, as ``torch.func``
    takes one example at a time); the first key never padded."""
    padded = x[..., 0] > 0.7
    return torch.cat([torch.zeros_like(padded[:, :1]), padded[:, 1:]], 1)


def _per_head(x):
    """An additive mask ``(B * heads, L, L)`` from each example's values."""
    return (x[..., :1] @ x[..., 1:2].transpose(1, 2)).repeat_interleave(HEADS, 0)


def _calls():
    """(name, module options, (query, key, value) from x and a memory, keyword arguments: values
    or functions of x)."""
    return [
        ("self", {}, lambda x, m, v: (x, x, x), {}),
        ("self-no-weights", {}, lambda x, m, v: (x, x, x), {"need_weights": False}),
        ("per-head-weights", {}, lambda x, m, v: (x, x, x), {"average_attn_weights": False}),
        ("padding", {}, lambda x, m, v: (x, x, x), {"key_padding_mask": _padding}),
        (
            "causal-hint",
            {},
            lambda x, m, v: (x, x, x),
            {"attn_mask": CAUSAL, "is_causal": True, "need_weights": False},
        ),
        ("bool-mask", {}, lambda x, m, v: (x, x, x), {"attn_mask": CAUSAL != 0}),
        (
            "mask-and-padding",
            {},
            lambda x, m, v: (x, x, x),
            {"attn_mask": CAUSAL, "key_padding_mask": lambda x: _padding(x).to(x.dtype) * -1e9},
        ),
        ("per-head-mask", {}, lambda x, m, v: (x, x, x), {"attn_mask": _per_head}),
        (
            "zero-attn",
            {"add_zero_attn": True},
            lambda x, m, v: (x, x, x),
            {"attn_mask": CAUSAL, "key_padding_mask": _padding, "need_weights": False},
        ),
        ("cross", {}, lambda x, m, v: (x, m, m), {}),
        ("distinct", {}, lambda x, m, v: (x, m, m.flip(1)), {"need_weights": False}),
        ("kdim-vdim", {"kdim": 3, "vdim": 7}, lambda x, m, v: (x, m[..., :3], v), {}),
        ("no-bias", {"bias": False}, lambda x, m, v: (x, x, x), {}),
    ]


def _keywords(kwargs, x):
    return {k: v(x) if callable(v) else v for k, v in kwargs.items()}


CALLS = _calls()


def _sequence_first(args: tuple) -> tuple:
    """Batch-first inputs as ``(T, B, E)``, one view per distinct input (self-attention's three
    inputs stay one tensor)."""
    views: dict[int, torch.Tensor] = {}
    return tuple(views.setdefault(id(t), t.transpose(0, 1)) for t in args)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name, options, inputs, kwargs", CALLS, ids=[c[0] for c in CALLS])
def test_forward_is_the_modules(name, options, inputs, kwargs, training, batch_first):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, **options)
    m = m.double().train(training)
    x = torch.randn(B, L, E, dtype=torch.float64)
    memory = torch.randn(B, S, E, dtype=torch.float64)
    value = torch.randn(B, S, 7, dtype=torch.float64)
    args = inputs(x, memory, value)
    args = args if batch_first else _sequence_first(args)
    kwargs = _keywords(kwargs, x)
    seen = []
    got = ghost_attention.forward(m, lambda p, a, o: seen.append(p), *args, **kwargs)
    want = m(*args, **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    if want[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    assert seen == ghost_attention.projections(m, *args)
    rows = [p.bias_rows for p in seen]  # the maps cover the packed rows once, in order
    assert rows[0].start == 0 and rows[-1].stop == 3 * E
    assert all(r.stop == n.start for r, n in itertools.pairwise(rows))


class Attend(nn.Module):
    """An attention module on a batch of sequences, pooled to three classes (a sequence-first
    module: on the sequence-first views of the same inputs, its output transposed back)."""

    def __init__(self, call, options, batch_first=True):
        super().__init__()
        _, self.options, self.inputs, self.kwargs = call
        self.att = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, **options)
        self.memory = nn.Linear(E, E)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        memory = self.memory(x[:, :S])  # per example: cross-attention on a computed memory
        value = torch.cat([memory, memory[..., :-1]], -1)[..., :7]
        args = self.inputs(x, memory, value)
        if not self.att.batch_first:
            args = _sequence_first(args)
        out = self.att(*args, **_keywords(self.kwargs, x))[0]
        out = out if self.att.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
@pytest.mark.parametrize("name, options, inputs, kwargs", CALLS, ids=[c[0] for c in CALLS])
def test_attention_norms_and_clipped_sums_are_torch_funcs(
    name, options, inputs, kwargs, batch_first, monkeypatch
):
    torch.manual_seed(1)
    model = Attend((name, options, inputs, kwargs), options, batch_first)
    got = _check(model, torch.randn(B, L, E), torch.randint(0, 3, (B,)), monkeypatch)
    assert "att.out_proj.weight" in got


def test_frozen_projections_leave_the_rest_trainable(monkeypatch):
    """Only the bias of the input projection trainable; then only ``out_proj`` (the module's
    forward is still replaced, so ``out_proj`` is called as a layer)."""
    torch.manual_seed(2)
    model = Attend(CALLS[0], {})
    model.att.in_proj_weight.requires_grad_(False)
    got = _check(model, torch.randn(B, L, E), torch.randint(0, 3, (B,)), monkeypatch)
    assert "att.in_proj_bias" in got and "att.in_proj_weight" not in got
    model.att.in_proj_bias.requires_grad_(False)
    got = _check(model, torch.randn(B, L, E), torch.randint(0, 3, (B,)), monkeypatch)
    assert "att.out_proj.weight" in got and "att.in_proj_bias" not in got


class Encoder(nn.Module):
    """Token embeddings, a pre-norm encoder layer and a decoder layer over a memory, as torch's
    transformer layers build them, pooled to three classes; sequence-first (``batch_first=False``,
    torch's default, its tutorials' layout): every layer on ``(T, B, E)``, the token embedding on
    ``(T, B)`` ids."""

    def __init__(self, batch_first=True):
        super().__init__()
        self.tok = nn.Embedding(11, E)
        options = {"dim_feedforward": 16, "dropout": 0.0, "batch_first": batch_first}
        self.enc = nn.TransformerEncoderLayer(E, HEADS, norm_first=True, **options)
        self.dec = nn.TransformerDecoderLayer(E, HEADS, activation="gelu", **options)
        self.head = nn.Linear(E, 3)
        self.batch_first = batch_first

    def forward(self, idx):
        h = self.tok(idx if self.batch_first else idx.T)
        memory = self.enc(h, src_key_padding_mask=idx == 0)
        out = self.dec(h, memory, tgt_mask=CAUSAL.to(h.dtype), tgt_is_causal=True)
        return self.head(out.mean(1 if self.batch_first else 0))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
def test_transformer_layers(batch_first, monkeypatch):
    torch.manual_seed(3)
    idx = torch.randint(1, 11, (B, L))
    idx[3:, -2:] = 0  # padding tokens of two examples
    got = _check(Encoder(batch_first), idx, torch.randint(0, 3, (B,)), monkeypatch)
    assert {"enc.self_attn.in_proj_weight", "dec.multihead_attn.in_proj_weight"} <= set(got)


def test_dp_sgd_takes_ghost_clipping_for_attention(monkeypatch):
    """``clipped_gradient_sum`` (DP-SGD's clipping) runs ghost clipping on an attention model,
    not ``torch.func``, with torch.func's result."""
    torch.manual_seed(4)
    model = Encoder().double()
    idx, y = torch.randint(1, 11, (B, L)), torch.randint(0, 3, (B,))
    _, clip, want = _reference(model, idx, y)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.func per-example gradients")

    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", refuse)
    got = dp_sgd_step.clipped_gradient_sum(model, idx, y, _loss, clip)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


class SequenceFirst(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.att = nn.MultiheadAttention(E, HEADS, **options)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        x = x.transpose(0, 1) if not self.att.batch_first else x
        out = self.att(x, x, x)[0]
        return self.head(out.mean(0 if not self.att.batch_first else 1))


class Unbatched(nn.Module):
    """Attention over the batch's rows (an unbatched call on ``(B, E)``): examples mixed."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        h = x.mean(1)
        return self.head(self.att(h, h, h)[0])


class OwnForward(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        return super().forward(2 * query, key, value, **kwargs)


class Twice(nn.Module):
    """One attention run twice a pass: self-attention then (``mixed``) cross-attention on the
    first call's output, whose maps split the packed rows otherwise; with ``kdim`` separate key
    and value weights (the bias packed across them)."""

    def __init__(self, mixed=False, kdim=None):
        super().__init__()
        self.att = nn.MultiheadAttention(E, HEADS, batch_first=True, kdim=kdim, vdim=kdim)
        self.head = nn.Linear(E, 3)
        self.mixed, self.kdim = mixed, kdim

    def forward(self, x):
        if self.kdim is not None:  # keys and values of their own width, both calls
            memory = torch.tanh(x[..., :1]).repeat(1, 1, self.kdim)
            h = self.att(x, memory, memory)[0]
            return self.head(self.att(h, memory, memory)[0].mean(1))
        h = self.att(x, x, x)[0]
        h = self.att(h, x, x)[0] if self.mixed else self.att(h, h, h)[0]
        return self.head(h.mean(1))


class SharedAcrossDepth(nn.Module):
    """One sequence-first ``nn.TransformerEncoderLayer`` applied three times (a universal
    transformer's, ALBERT's sharing)."""

    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        h = x.transpose(0, 1)
        for _ in range(3):
            h = self.block(h)
        return self.head(h.mean(0))


@pytest.mark.parametrize(
    "build",
    [Twice, lambda: Twice(mixed=True), lambda: Twice(kdim=5), SharedAcrossDepth],
    ids=["self-twice", "self-then-cross", "separate-weights-twice", "shared-across-depth"],
)
def test_an_attention_run_several_times(build, monkeypatch):
    """Each range of the packed rows merged over the calls that mapped it (cut at every call's
    boundaries where the calls split the rows otherwise): torch.func's norms and sums."""
    torch.manual_seed(6)
    got = _check(build(), torch.randn(B, L, E), torch.randint(0, 3, (B,)), monkeypatch)
    assert any(k.endswith("out_proj.weight") for k in got)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: SequenceFirst(batch_first=True, add_bias_kv=True), "add_bias_kv"),
        (Unbatched, "unbatched"),
    ],
    ids=["bias-kv", "unbatched"],
)
def test_what_is_not_covered_is_refused_and_falls_back(build, match):
    torch.manual_seed(5)
    model = build().double()  # built here: its weights whatever the tests collected drew
    x, y = torch.randn(B, L, E, dtype=torch.float64), torch.randint(0, 3, (B,))
    with pytest.raises(UnsupportedModelError, match=match):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    assert "forward" not in model.att.__dict__  # the module's own forward again
    falls_back(model, x, y, match)


def test_a_subclass_with_its_own_forward_is_refused():
    model = SequenceFirst(batch_first=True)
    model.att = OwnForward(E, HEADS, batch_first=True)
    x, y = torch.randn(B, L, E), torch.randint(0, 3, (B,))
    with pytest.raises(UnsupportedModelError, match="overrides"):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)


class TokenEncoder(nn.Module):
    """Token embeddings, one ``nn.TransformerEncoderLayer``, mean pooling, two classes."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, idx):
        return self.head(self.enc(self.tok(idx)).mean(1))


def _audited(seed: int, sigma: float, build) -> tuple[str, tuple[str, ...]]:
    """A white-box canary audit (test_whitebox's DP-SGD run with canaries) of 100 steps of the
    model and data ``build()`` gives, claiming sigma 1.5 at q 0.05: its verdict and rejected
    tests."""
    from tests.attacks.test_whitebox import _dpsgd

    torch.manual_seed(seed)
    model, data = build()
    canaries = _dpsgd(sigma, 1.5, seed=seed, steps=100, m=500, model=model, data=data)
    result = canaries.audit(delta=1e-5)
    return result.verdict, tuple(result.conformance.rejected)


def audit_sees_its_bugs(monkeypatch, build) -> None:
    """The model's DP-SGD, clipped by ghost clipping (``torch.func`` made to fail), audited
    white-box: as claimed it is not a violation, and half the noise or clipping switched off are
    caught, at each of three seeds (the audit's error rates are tested on many seeds in
    ``tests/attacks/test_conformance.py``; here the clipping path is the model's)."""
    from privkit.mechanisms.mutations import MUTATIONS, mutated

    def refuse(*args, **kwargs):
        raise AssertionError("torch.func per-example gradients")

    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", refuse)
    for seed in range(3):
        assert _audited(seed, 1.5, build)[0] != "violation"
        assert _audited(seed, 0.75, build) == ("violation", ("noise",))
        with mutated(MUTATIONS["clipping off"]):
            assert _audited(seed, 1.5, build) == ("violation", ("influence",))


def test_a_transformers_dp_sgd_audit_sees_its_bugs(monkeypatch):
    """A torch transformer's DP-SGD (ghost clipping through its attention) audited white-box."""

    def build():
        data = torch.randint(0, 50, (400, 12)), torch.randint(0, 2, (400,))
        return TokenEncoder(), data

    audit_sees_its_bugs(monkeypatch, build)
